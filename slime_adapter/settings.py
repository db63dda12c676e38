"""The adapter's settings, read from slime's `args` by slime's own names, with one documented default each.

slime passes one big argparse namespace to the rollout function; older and newer slime versions differ in
which attributes exist, so every value is read with a default instead of assuming the attribute.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from slime_adapter.auth import remember_token, token_from
from slime_adapter.masks.verify import VERIFY_MODES as LOSS_MASK_VERIFY_MODES

__all__ = ["DEFAULT_BUFFER_URL", "DEFAULT_NUM_EPOCH", "FORK_POLICIES", "LOSS_MASK_VERIFY_MODES", "READ_FORMATS",
           "READ_FORMAT_ENV", "AgentRolloutSettings"]

DEFAULT_BUFFER_URL = "http://127.0.0.1:8889"
# slime's own agent rollout sent 3 epochs when `--num-epoch` was unset; a single pass can starve a trainer
# whose `num_rollout` needs more data than one pass, and the fetch loop would then wait for ever.
DEFAULT_NUM_EPOCH = 3
# what the trainer receives from a token-path record whose history forked (see `fork_policy`)
FORK_POLICIES: tuple[str, ...] = ("last", "all")
# what the buffer does with a group staler than `max_staleness` (rollout_buffer.runs.policy)
STALE_POLICIES: tuple[str, ...] = ("requeue", "drop", "keep")
# how the message path checks its tokens against the chat template: LOSS_MASK_VERIFY_MODES, from masks/verify.py
# the answer form reads ask for: the packed binary form (numpy arrays) or JSON (for debugging)
READ_FORMATS: tuple[str, ...] = ("packed", "json")
READ_FORMAT_ENV = "ROLLOUT_BUFFER_READ_FORMAT"


def _get(args: Any, name: str, default: Any) -> Any:
    """`args.name`, or `default` when the attribute is missing or None (argparse's "not given")."""
    value = getattr(args, name, None)
    return default if value is None else value


INPUT_KEY_NAMES: tuple[str, ...] = ("input_key", "label_key", "metadata_key", "tool_key")


def input_keys_of(args: Any, prefix: str = "") -> dict[str, str | None]:
    """slime's dataset keys the namespace has (`{prefix}input_key`, ...), by their unprefixed names; a
    prefixed one that is None falls back to the plain one (slime's `--eval-input-key` rule)."""
    keys: dict[str, str | None] = {}
    for name in INPUT_KEY_NAMES:
        value = getattr(args, prefix + name, None) if prefix else None
        if value is None and hasattr(args, name):
            value = getattr(args, name)
        if value is not None or hasattr(args, name):
            keys[name] = value
    return keys


def _start_options(value: Any) -> dict[str, Any]:
    """`agent_start_options` as a dict: given as one, or as a JSON object (a command line's form)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"agent_start_options is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"agent_start_options must be a JSON object of /start_rollout fields, got "
                         f"{type(value).__name__}")
    return dict(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _moe_shape(args: Any) -> tuple[int, int] | None:
    """(num_layers, moe_router_topk): the shape of one token's routed experts, when args say both."""
    layers, topk = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
    return (int(layers), int(topk)) if layers and topk else None


def _rewards_normalization_disabled(args: Any) -> bool:
    enabled = getattr(args, "rewards_normalization", None)  # slime: --disable-rewards-normalization stores False
    if enabled is not None:
        return not bool(enabled)
    return bool(_get(args, "disable_rewards_normalization", False))


def _list_or_none(value: Any, kind: type) -> list[Any] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, (str, int)) else list(value)
    return [kind(item) for item in items] or None


@dataclass(frozen=True)
class AgentRolloutSettings:
    """Everything the agent rollout reads from slime's `args`. Defaults, by field:

    - `buffer_url` (`rollout_buffer_url`, slime's `--rollout-buffer-url`; else `agent_rollout_buffer_url`,
      a name slime's parser does not know, read as a fallback for namespaces built by hand; else env
      `ROLLOUT_BUFFER_URL`): "http://127.0.0.1:8889", the buffer's default address. A trailing "/" is removed.
    - `buffer_token` (`agent_rollout_buffer_token`; else env `ROLLOUT_BUFFER_AUTH_TOKEN`; else the file
      named by `ROLLOUT_BUFFER_AUTH_TOKEN_FILE`): None. The buffer's bearer token (`slime_adapter.auth`),
      sent with every request to `buffer_url`; never shown in the settings' repr.
    - `loss_mask_type` (`loss_mask_type`): "qwen". Only used for records without `turns`, which are
      re-rendered with the chat template: slime's choices "qwen" (Qwen2.5 ChatML), "qwen3", "qwen3_5"
      (generation prompt ending with `<think>\n`, never trained) and "distill_qwen", or a type added with
      `slime_adapter.masks.loss_mask.register_loss_mask_type`. Tokens that merge template and generated
      characters get mask 0 and are counted (`metadata["mask_edge_tokens"]`, `rollout/mask_edge_tokens`);
      a conversation the template cannot render exactly is kept with an all-zero mask and flagged
      (`metadata["mask_refused"]`, `rollout/mask_refused`). See `slime_adapter.masks.loss_mask`.
    - `n_samples_per_prompt` (`n_samples_per_prompt`): 1. Sent as `num_repeat_per_sample`.
    - `rollout_batch_size` (`rollout_batch_size`): 1. Groups returned per step.
    - `hf_checkpoint` (`hf_checkpoint`): None. Tokenizer path, sent as `tokenizer_path`; without it the
      message path (records without `turns`) raises, the token path needs no tokenizer.
    - `prompt_data` (`prompt_data`): None. Sent as `input_file`; starting a run without it raises.
    - `max_response_len` (`rollout_max_response_len`): None, meaning `max_tokens` is not sent and the
      task's / engine's own limit applies.
    - `temperature` (`rollout_temperature`): 1.0. `top_p` (`rollout_top_p`): 1.0.
    - `task_type` (`rollout_task_type`): "math".
    - `disable_rewards_normalization`: not `rewards_normalization` (slime's `--disable-rewards-normalization`
      stores False there); a namespace without that attribute may set `disable_rewards_normalization`.
      False by default. See `reward_field`.
    - `input_keys`: slime's dataset keys `input_key`, `label_key`, `metadata_key`, `tool_key`, those the
      namespace has (slime's defaults: "input", None, "metadata", "tools"); sent to `/start_rollout`, where
      they map every input line (see `rollout_buffer.tasks.input_keys`). Absent ones are not sent.
    - `top_k` (`rollout_top_k`): sent in `sampling_params` unless None or -1 (slime's default, "off");
      `stop` (`rollout_stop`), `stop_token_ids` (`rollout_stop_token_ids`): sent when set.
    - `min_batch_collection_ratio` (`min_batch_collection_ratio`): 1.0. A step returns as soon as it holds
      `ceil(ratio * rollout_batch_size)` groups and the buffer has no further group ready (a read that does
      not wait); 1.0 waits for the whole `rollout_batch_size`. Must be in (0, 1]. A short step hands slime
      fewer groups; slime's own GRPO normalisation then treats the step as one group, so pair a ratio
      below 1 with the buffer's per-group normalisation (the `math` task's) and
      `--disable-rewards-normalization`.
    - `max_failed_groups` (`agent_max_consecutive_failed_groups`): max(8, rollout_batch_size). When this
      many groups in a row come back with every member failed, `generate_rollout` raises `RunFailedError`
      (naming the run, the failure counts and the first error) instead of polling on; 0 turns it off. A
      native run that has ended with nothing left to hand over raises it at once, whatever this says.
    - `fetch_retry_times` (`fetch_trajectory_retry_times`): -1, unlimited consecutive failed fetches.
    - `use_wandb` (`use_wandb`): False. `wandb_project` (`wandb_project`): "rollout-buffer";
      `wandb_group` (`wandb_group`): None; `wandb_always_use_train_step`: False;
      `global_batch_size` (`global_batch_size`): None (the train-step conversion then uses `rollout_id`).
    - `remote_engine_url`: "http://{sglang_router_ip}:{sglang_router_port}" when both are set, else ""
      (the buffer's task then uses its own default).
    - `num_process` (`rollout_num_process`): 32, the buffer's own default concurrency.
    - `num_epoch` (`num_epoch`): 3 (see `DEFAULT_NUM_EPOCH`).
    - `run_id` (`agent_rollout_run_id`): None; the buffer derives a stable id from the run's settings.
    - `fetch_timeout_s` (`agent_fetch_timeout_s`): 100.0, one long poll of `/get_rollout_data`.
    - `fetch_backoff_s` (`agent_fetch_backoff_s`): 1.0, first wait after an empty or failed fetch,
      doubled each consecutive failure up to `fetch_backoff_max_s` (`agent_fetch_backoff_max_s`): 30.0.
    - `start_options` (`agent_start_options`): {}. More `/start_rollout` fields for the run, a dict or a JSON
      object string (e.g. `{"max_task_attempts": 10, "rollout_timeout_s": 600}`); a field the adapter sets
      from slime's own arguments is refused, so one setting has one source.
    - `start_attempts` (`agent_start_rollout_attempts`): 8 tries of `/start_rollout`;
      `start_backoff_s` (`agent_start_rollout_backoff_s`): 1.0, doubled per try up to 30 s;
      `start_timeout_s` (`agent_start_rollout_timeout_s`): 30.0 per request.
    - `fork_policy` (`agent_fork_policy`): "last". A token-path record whose later turn's prompt does not
      extend its history forks into 2+ pieces. slime's `RolloutDataSourceWithBuffer.add_samples` asserts
      every group has exactly `n_samples_per_prompt` samples and its reward normalisation reshapes by that
      number, so by default only the last piece is kept: the one that ends with the final answer and
      carries the reward. The dropped pieces and their tokens are logged as `rollout/fork_dropped_pieces`,
      `rollout/fork_dropped_tokens` (prompt + response) and `rollout/fork_dropped_generated_tokens`.
      "all" keeps every piece, for trainers that accept uneven groups. Dropping a whole record is not
      offered: it would change the group's size just the same.
    - `mask_offpolicy` (slime's `mask_offpolicy_in_partial_rollout`): False. When set, a token-path sample
      trains only the tokens generated under the newest policy version in its record: a generation aborted
      by `POST /policy_version {"abort_in_flight": true}` and continued under a new version keeps its
      earlier tokens with mask 0 (per token, from `turns[].version_spans`), as slime masks the previous
      generation of a partial rollout; counted in `rollout/offpolicy_masked_tokens`. (The buffer always
      continues aborted generations, so slime's `--partial-rollout` need not be set.)
    - `lease_s` (`agent_lease_s`): 3600.0. Every read leases its batch: the buffer keeps the groups until this
      adapter acknowledges them (with the next step's first read, once slime has trained them; before the
      step returns on the last step, `num_rollout`), and a read retried after a lost answer gets the same
      batch. A lease that runs out (the trainer vanished without restarting) gives the groups back to the
      buffer; a restarted trainer ends its predecessor's leases at once (groups its checkpoint holds are
      acknowledged, the rest given back), so a long lease costs nothing. While a batch is held (read, not yet
      acknowledged) the adapter renews its lease every `lease_s / 3` (`slime_adapter.reading.lease_renewal`).
    - `loss_mask_verify` (`agent_loss_mask_verify`): "cheap". How records without `turns` check their
      re-rendered tokens: "cheap" invariants, "full" (a second `apply_chat_template(tokenize=True)`
      compared token for token, twice the cost), or "off".
    - `max_staleness` (`agent_max_staleness`): None (unbounded). Sent as the run's `max_staleness`, with
      `rollout_batch_size` (the admission rule's groups per read): no handed sample is more policy versions
      old than this; every read sends `policy_version = rollout_id`.
    - `stale_policy` (`agent_stale_policy`): None (the buffer's default, "requeue"); "drop" or "keep".
    - `group_filter` (`agent_group_filter`): None. "nonzero_std" (DAPO's dynamic sampling) or a dotted path
      to an `is_valid_group` function importable by the buffer; dropped groups are replaced by the buffer,
      so steps stay full, and counted as `rollout/dynamic_filter/drop_<reason>`.
    - `dynamic_filter_path` (slime's `dynamic_sampling_filter_path`): None. slime's filter function, run
      on every group this adapter reads, with slime's signature and `DynamicFilterOutput`
      (`slime_adapter.hooks.dynamic_filter`); `over_sampling_batch_size` (slime's): None, else the groups one
      read asks for at least; the surplus stays leased for the next step.
    - `routing_replay` (slime's `use_rollout_routing_replay`), `moe_shape` (`num_layers`,
      `moe_router_topk`): the run asks SGLang for routed experts; samples carry them in that shape.
      `top_p` below 1 asks for top-p replay (`custom_params.return_top_p_token_ids`), as slime does.
    - `partial_rollout` (slime's): False. Records generated under several policy versions get
      `metadata["start_rollout_id"]` (the oldest), as slime marks samples continued across an update.
    - `read_format` (`agent_read_format`, else env `ROLLOUT_BUFFER_READ_FORMAT`): "packed". Reads ask for
      the buffer's packed binary answer: token ids and logprobs arrive as numpy arrays and samples are built
      from them without a Python object per token. "json" asks for plain JSON (to look at the wire while
      debugging); the samples are the same. A buffer without the packed form answers JSON either way.
    """

    buffer_url: str = DEFAULT_BUFFER_URL
    loss_mask_type: str = "qwen"
    n_samples_per_prompt: int = 1
    rollout_batch_size: int = 1
    hf_checkpoint: str | None = None
    prompt_data: str | None = None
    max_response_len: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    task_type: str = "math"
    disable_rewards_normalization: bool = False
    fetch_retry_times: int = -1
    use_wandb: bool = False
    wandb_project: str = "rollout-buffer"
    wandb_group: str | None = None
    wandb_always_use_train_step: bool = False
    global_batch_size: int | None = None
    remote_engine_url: str = ""
    num_process: int = 32
    num_epoch: int = DEFAULT_NUM_EPOCH
    run_id: str | None = None
    fetch_timeout_s: float = 100.0
    fetch_backoff_s: float = 1.0
    fetch_backoff_max_s: float = 30.0
    start_attempts: int = 8
    start_backoff_s: float = 1.0
    start_timeout_s: float = 30.0
    fork_policy: str = "last"
    loss_mask_verify: str = "cheap"
    lease_s: float = 3600.0
    mask_offpolicy: bool = False
    input_keys: dict[str, str | None] = field(default_factory=dict)
    top_k: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_batch_collection_ratio: float = 1.0
    max_failed_groups: int = 8
    max_staleness: int | None = None
    stale_policy: str | None = None
    group_filter: str | None = None
    buffer_token: str | None = field(default=None, repr=False)
    read_format: str = "packed"
    dynamic_filter_path: str | None = None
    over_sampling_batch_size: int | None = None
    routing_replay: bool = False
    moe_shape: tuple[int, int] | None = None
    partial_rollout: bool = False
    start_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: Any) -> AgentRolloutSettings:
        """Read slime's namespace (any object with attributes); see the class docstring for defaults."""
        url = (_get(args, "rollout_buffer_url", None) or _get(args, "agent_rollout_buffer_url", None)
               or os.environ.get("ROLLOUT_BUFFER_URL") or DEFAULT_BUFFER_URL)
        batch = int(_get(args, "rollout_batch_size", 1))
        top_k = _get(args, "rollout_top_k", None)
        failed_groups = _get(args, "agent_max_consecutive_failed_groups", None)
        ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
        engine_url = f"http://{ip}:{port}" if ip and port else ""
        max_len = getattr(args, "rollout_max_response_len", None)
        global_batch = getattr(args, "global_batch_size", None)
        max_staleness = _get(args, "agent_max_staleness", None)
        settings = cls(
            buffer_url=str(url).rstrip("/"),
            loss_mask_type=str(_get(args, "loss_mask_type", "qwen")),
            n_samples_per_prompt=int(_get(args, "n_samples_per_prompt", 1)),
            rollout_batch_size=batch,
            hf_checkpoint=_get(args, "hf_checkpoint", None),
            prompt_data=_get(args, "prompt_data", None),
            max_response_len=int(max_len) if max_len is not None else None,
            temperature=float(_get(args, "rollout_temperature", 1.0)),
            top_p=float(_get(args, "rollout_top_p", 1.0)),
            task_type=str(_get(args, "rollout_task_type", "math")),
            disable_rewards_normalization=_rewards_normalization_disabled(args),
            fetch_retry_times=int(_get(args, "fetch_trajectory_retry_times", -1)),
            use_wandb=bool(_get(args, "use_wandb", False)),
            wandb_project=str(_get(args, "wandb_project", "rollout-buffer")),
            wandb_group=_get(args, "wandb_group", None),
            wandb_always_use_train_step=bool(_get(args, "wandb_always_use_train_step", False)),
            global_batch_size=int(global_batch) if global_batch else None,
            remote_engine_url=engine_url,
            num_process=int(_get(args, "rollout_num_process", 32)),
            num_epoch=int(_get(args, "num_epoch", DEFAULT_NUM_EPOCH)),
            run_id=_get(args, "agent_rollout_run_id", None),
            fetch_timeout_s=float(_get(args, "agent_fetch_timeout_s", 100.0)),
            fetch_backoff_s=float(_get(args, "agent_fetch_backoff_s", 1.0)),
            fetch_backoff_max_s=float(_get(args, "agent_fetch_backoff_max_s", 30.0)),
            start_attempts=int(_get(args, "agent_start_rollout_attempts", 8)),
            start_backoff_s=float(_get(args, "agent_start_rollout_backoff_s", 1.0)),
            start_timeout_s=float(_get(args, "agent_start_rollout_timeout_s", 30.0)),
            fork_policy=str(_get(args, "agent_fork_policy", "last")),
            loss_mask_verify=str(_get(args, "agent_loss_mask_verify", "cheap")),
            lease_s=float(_get(args, "agent_lease_s", 3600.0)),
            mask_offpolicy=bool(_get(args, "mask_offpolicy_in_partial_rollout", False)),
            input_keys=input_keys_of(args),
            top_k=None if top_k is None or int(top_k) == -1 else int(top_k),
            stop=_list_or_none(_get(args, "rollout_stop", None), str),
            stop_token_ids=_list_or_none(_get(args, "rollout_stop_token_ids", None), int),
            min_batch_collection_ratio=float(_get(args, "min_batch_collection_ratio", 1.0)),
            max_failed_groups=max(8, batch) if failed_groups is None else int(failed_groups),
            max_staleness=None if max_staleness is None else int(max_staleness),
            stale_policy=_get(args, "agent_stale_policy", None),
            group_filter=_get(args, "agent_group_filter", None),
            buffer_token=token_from(args),
            read_format=str(_get(args, "agent_read_format", None) or os.environ.get(READ_FORMAT_ENV) or "packed")
            .strip().lower(),
            dynamic_filter_path=_get(args, "dynamic_sampling_filter_path", None),
            over_sampling_batch_size=_optional_int(_get(args, "over_sampling_batch_size", None)),
            routing_replay=bool(_get(args, "use_rollout_routing_replay", False)),
            moe_shape=_moe_shape(args),
            partial_rollout=bool(_get(args, "partial_rollout", False)),
            start_options=_start_options(_get(args, "agent_start_options", None)),
        )
        settings.check()
        remember_token(settings.buffer_url, settings.buffer_token)
        return settings

    def check(self) -> None:
        """Refuse values that would make the rollout loop meaningless (zero-sized steps, no tries)."""
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be >= 1, got {self.rollout_batch_size}")
        if self.fetch_retry_times < -1:
            raise ValueError(f"fetch_trajectory_retry_times must be -1 (unlimited) or >= 0, got {self.fetch_retry_times}")
        if self.start_attempts < 1:
            raise ValueError(f"agent_start_rollout_attempts must be >= 1, got {self.start_attempts}")
        if not 0 < self.lease_s <= 86_400:
            raise ValueError(f"agent_lease_s must be in (0, 86400], got {self.lease_s}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"agent_fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        if self.fork_policy not in FORK_POLICIES:
            raise ValueError(f"agent_fork_policy must be one of {FORK_POLICIES}, got {self.fork_policy!r}")
        if not 0 < self.min_batch_collection_ratio <= 1:
            raise ValueError(f"min_batch_collection_ratio must be in (0, 1], got {self.min_batch_collection_ratio}")
        if self.max_failed_groups < 0:
            raise ValueError(f"agent_max_consecutive_failed_groups must be >= 0 (0: off), got {self.max_failed_groups}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"agent_max_staleness must be >= 0, got {self.max_staleness}")
        if self.stale_policy is not None and self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"agent_stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.read_format not in READ_FORMATS:
            raise ValueError(f"agent_read_format ({READ_FORMAT_ENV}) must be one of {READ_FORMATS}, "
                             f"got {self.read_format!r}")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(f"over_sampling_batch_size must be >= 1, got {self.over_sampling_batch_size}")
        if self.loss_mask_verify not in LOSS_MASK_VERIFY_MODES:
            raise ValueError(f"agent_loss_mask_verify must be one of {LOSS_MASK_VERIFY_MODES}, "
                             f"got {self.loss_mask_verify!r}")

    @property
    def min_groups_per_step(self) -> int:
        """`ceil(min_batch_collection_ratio * rollout_batch_size)`, at least 1."""
        return max(1, math.ceil(self.min_batch_collection_ratio * self.rollout_batch_size - 1e-9))

    def sampling_extras(self) -> dict[str, Any]:
        """slime's optional sampling settings that are set: `top_k`, `stop`, `stop_token_ids`."""
        extras: dict[str, Any] = {"top_k": self.top_k, "stop": self.stop, "stop_token_ids": self.stop_token_ids}
        if self.top_p != 1.0:  # slime asks SGLang for top-p replay whenever it samples below top_p 1
            extras["custom_params"] = {"return_top_p_token_ids": True}
        if self.routing_replay:  # slime's --use-rollout-routing-replay: SGLang's return_routed_experts
            extras["return_routed_experts"] = True
        return {name: value for name, value in extras.items() if value is not None}

    @property
    def samples_per_step(self) -> int:
        """slime's step size in samples: `rollout_batch_size * n_samples_per_prompt`."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def reward_field(self, has_raw_reward: bool) -> str:
        """Which record field becomes `Sample.reward`.

        The buffer's group hook may normalise rewards (GRPO-style) and then keeps the original in
        `raw_reward`. With normalisation enabled (`disable_rewards_normalization` false) and a record that
        carries `raw_reward`, the normalised `reward` is trained on. Otherwise the raw value is: `raw_reward`
        when present, else `reward` (which then was never normalised). `metadata["raw_reward"]` always
        holds the raw value, so slime's `raw_reward` logging is unaffected.
        """
        if not self.disable_rewards_normalization and has_raw_reward:
            return "reward"
        return "raw_reward" if has_raw_reward else "reward"
