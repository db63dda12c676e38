"""Wire format shared by the service and the trainer side (slime-compatible).

These pydantic models are the single definition of what crosses HTTP. `slime_adapter` may import this
module for types; it imports nothing else from `rollout_buffer`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_buffer.wire.strict import StrictBody

RecordStatus = Literal["completed", "truncated", "aborted", "failed"]
TOKEN_ID_MAX = 2**31 - 1  # ids are stored as int32
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")


# The per-call `meta_info` fields a turn keeps (`Turn.calls`), as SGLang names them.
CALL_META_KEYS: frozenset[str] = frozenset({
    "weight_version", "prompt_tokens", "cached_tokens", "completion_tokens",
    "spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct",
})


def check_top_p(num_ids: int, offsets: Any, num_outputs: int) -> None:
    """Top-p replay offsets: `num_outputs + 1` values from 0 to `num_ids`, never decreasing."""
    if len(offsets) != num_outputs + 1:
        raise ValueError(f"turns[].top_p_token_offsets has {len(offsets)} values, output_ids + 1 is {num_outputs + 1}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_ids:
        raise ValueError("turns[].top_p_token_offsets must start at 0 and end at len(top_p_token_ids)")
    if any(int(b) < int(a) for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError("turns[].top_p_token_offsets must not decrease")


class Turn(BaseModel):
    """One engine call, token-exact: what the model saw and what it sampled."""

    model_config = ConfigDict(extra="ignore")

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None = None
    finish_reason: str | None = None
    weight_version: str | int | None = None
    # `[[version, output tokens], ...]` over output_ids, when the turn was generated under more than one
    # policy version (an abort continued under a new one); `weight_version` is then the oldest.
    version_spans: list[tuple[int | None, int]] | None = None
    # One small dict per engine call of the turn (an aborted generation continued is several calls): what
    # SGLang's `meta_info` said that a trainer reads, `weight_version` (the engine's own string),
    # `prompt_tokens`, `cached_tokens`, `completion_tokens` and the `spec_*` counters (see CALL_META_KEYS).
    calls: list[dict[str, Any]] | None = None
    # MoE routing replay (SGLang's `return_routed_experts`): int32 expert ids, flat, rows of
    # `num_layers * topk` for the tokens `[routed_experts_start_len, len(prompt_ids) + len(output_ids) - 1)`.
    routed_experts: list[int] | None = None
    routed_experts_start_len: int | None = Field(default=None, ge=0)
    # Top-p replay (SGLang's `return_top_p_token_ids`): the kept ids of output token i are
    # `top_p_token_ids[top_p_token_offsets[i]:top_p_token_offsets[i + 1]]`.
    top_p_token_ids: list[int] | None = None
    top_p_token_offsets: list[int] | None = None

    @model_validator(mode="after")
    def _replay_fields(self) -> "Turn":
        if self.calls is not None:
            for call in self.calls:
                if not isinstance(call, dict) or set(call) - CALL_META_KEYS:
                    raise ValueError(f"turns[].calls entries are objects with keys among {sorted(CALL_META_KEYS)}")
        experts = self.routed_experts
        if experts and (min(experts) < 0 or max(experts) > TOKEN_ID_MAX):
            raise ValueError("turns[].routed_experts must be int32 expert ids >= 0")
        if (self.top_p_token_ids is None) != (self.top_p_token_offsets is None):
            raise ValueError("turns[].top_p_token_ids and top_p_token_offsets come together")
        if self.top_p_token_offsets is not None and self.top_p_token_ids is not None:
            check_top_p(len(self.top_p_token_ids), self.top_p_token_offsets, len(self.output_ids))
        return self

    @model_validator(mode="after")
    def _spans_cover_outputs(self) -> "Turn":
        if self.version_spans is not None:
            if any(count < 0 for _, count in self.version_spans):
                raise ValueError("turns[].version_spans counts must be >= 0")
            covered = sum(count for _, count in self.version_spans)
            if covered != len(self.output_ids):
                raise ValueError(f"turns[].version_spans cover {covered} tokens, output_ids has {len(self.output_ids)}")
        return self

    @model_validator(mode="after")
    def _logprobs_match_outputs(self) -> "Turn":
        for name in ("prompt_ids", "output_ids"):
            ids = getattr(self, name)
            if ids and (min(ids) < 0 or max(ids) > TOKEN_ID_MAX):
                raise ValueError(f"turns[].{name}: token ids must lie in [0, 2^31)")
        if self.output_logprobs is not None and len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"turns[].output_logprobs has {len(self.output_logprobs)} values for "
                f"{len(self.output_ids)} output_ids"
            )
        if self.output_logprobs:
            # One C-speed pass: the sum is NaN or +inf exactly when some value is NaN or +inf.
            total = sum(self.output_logprobs)
            if total != total or total == math.inf:
                raise ValueError("turns[].output_logprobs must be finite numbers (or -inf)")
        return self


class TrajectoryRecord(BaseModel):
    """One finished rollout of one prompt: the unit `/buffer/write` stores."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    uid: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    reward: float
    extra_info: dict[str, Any] = Field(default_factory=dict)
    status: RecordStatus = "completed"
    finish_reason: str | None = None
    raw_reward: float | None = None
    tools: list[dict[str, Any]] | None = None
    weight_version: str | int | None = None
    timestamp: float | None = None
    turns: list[Turn] | None = None
    run_id: str | None = None
    epoch: int | None = Field(default=None, ge=0, le=1_000_000)
    # The policy version the record was generated under: its oldest turn's (see rollout_buffer.wire.versions);
    # derived from the turns when absent.
    policy_version: int | None = Field(default=None, ge=0)
    # Which rollout of its group this record belongs to (0, then 1, 2, ... for groups rolled out again);
    # the runtime sets it, and a write of an older generation is refused.
    generation: int | None = Field(default=None, ge=0)

    def to_store(self) -> dict[str, Any]:
        """The record as the store packs it: plain fields, and the validated turn objects as they are
        (no copy of thousands of token ids into dicts first)."""
        data = self.model_dump(exclude={"turns"})
        data["turns"] = self.turns
        return data

    @field_validator("instance_id", "uid", mode="before")
    @classmethod
    def _ids_as_text(cls, value: Any) -> Any:
        # slime's data files carry integer instance ids; the buffer keys everything by text.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("reward", "raw_reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number (got NaN or infinity)")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no string 'role'")
        return value


class StartRolloutRequest(BaseModel):
    """Body of `/start_rollout`. slime sends every value as text; pydantic coerces. Numbers are finite and
    in range (the run options in `extra` are checked by `rollout_buffer.runtime.options`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    task_type: str = Field(min_length=1)
    # required, except by an `external` run (the agent gateway: sessions come from clients, not a file)
    input_file: str = ""
    num_process: int = Field(default=32, ge=1, le=65536)
    num_epoch: int = Field(default=1, ge=1, le=1_000_000)
    num_repeat_per_sample: int = Field(default=1, ge=1, le=4096)
    remote_engine_url: str = ""
    remote_buffer_url: str = ""
    max_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    tokenizer_path: str | None = None
    # slime's resume list: instance ids of trained groups, one entry per trained group (an id listed k
    # times had its groups of epochs 0..k-1 trained), as slime's own clients send them.
    skip_instance_ids: list[str] = Field(default_factory=list)
    # The exact form: "<epoch>:<instance_id>" keys of trained groups (`meta_info.finished_group_keys`).
    skip_groups: list[str] = Field(default_factory=list)
    run_id: str | None = None
    min_valid_group_size: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _input_file_unless_external(self) -> "StartRolloutRequest":
        if not self.input_file and self.task_type != "external":
            raise ValueError("input_file: required (only task_type 'external' runs without one)")
        return self

    @field_validator("skip_groups", mode="before")
    @classmethod
    def _group_keys(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, list):
            for i, key in enumerate(value):
                epoch, sep, instance_id = str(key).partition(":")
                if not (sep and instance_id and epoch.isdecimal()):
                    raise ValueError(f"skip_groups[{i}] is not '<epoch>:<instance_id>': {key!r}")
            return [str(v) for v in value]
        return value

    @field_validator("skip_instance_ids", mode="before")
    @classmethod
    def _skip_ids_as_text(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, list):
            return [str(v) for v in value]
        return value

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sampling_params_dict(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("remote_engine_url", mode="before")
    @classmethod
    def _engine_url_list(cls, value: Any) -> Any:
        # Several engines without a router: a JSON list is kept as one comma-separated string, the form a
        # slime-style text field can carry too (the runtime splits it).
        if isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise ValueError("a list of engine URLs must hold only strings")
            return ",".join(value)
        return value


BATCH_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
# A long poll holds a connection at most this long; a lease is at least a second (documented in docs/wire.md).
MAX_WAIT_S = 60.0
MIN_LEASE_S = 1.0


class GetRolloutDataRequest(StrictBody):
    """Body of `/get_rollout_data`: `{}` reads every ready group (slime's semantics: handed over at once).

    `lease_s` leases the batch instead: its groups stay stored until acknowledged (`ack` here, or
    `POST /ack`), and reading again with the same `batch_id` returns the same batch (a retry after a lost
    answer). A reader that sends no `batch_id` gets a new one in `meta_info.batch_id`."""

    num: int | None = Field(default=None, ge=1)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_WAIT_S)
    run_id: str | None = None
    lease_s: float | None = Field(default=None, ge=MIN_LEASE_S, le=86_400.0)
    batch_id: str | None = Field(default=None, pattern=BATCH_ID_PATTERN)
    ack: list[Annotated[str, Field(pattern=BATCH_ID_PATTERN)]] = Field(default_factory=list, max_length=1000)
    # The trainer's policy version (slime: the rollout id): recorded as the run's, and what this read's
    # staleness is measured against.
    policy_version: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _batch_needs_lease(self) -> "GetRolloutDataRequest":
        if self.batch_id is not None and self.lease_s is None:
            raise ValueError("batch_id is only meaningful with lease_s (a leased read)")
        return self


class AckRequest(StrictBody):
    """Body of `/ack`: the leased batches whose samples the trainer now holds."""

    batch_id: str | None = Field(default=None, pattern=BATCH_ID_PATTERN)
    batch_ids: list[Annotated[str, Field(pattern=BATCH_ID_PATTERN)]] = Field(default_factory=list, max_length=1000)
    run_id: str | None = None
    # renew the leases (each by its own lease_s, from now) instead of acknowledging: a step still in hand
    renew: bool = False

    @property
    def all_ids(self) -> list[str]:
        ids = ([self.batch_id] if self.batch_id else []) + self.batch_ids
        return list(dict.fromkeys(ids))


MAX_BATCH_RECORDS = 10_000


class BatchWriteRequest(StrictBody):
    """Body of `/buffer/write_batch`: many records of one run in one request."""

    records: list[TrajectoryRecord] = Field(min_length=1, max_length=MAX_BATCH_RECORDS)
    run_id: str | None = None



class PolicyVersionRequest(StrictBody):
    """Body of `/policy_version`: the trainer's policy version, for trainers that do not send it with
    their reads. `abort_in_flight` aborts the engine's in-flight generations (they continue under the new
    version, recorded per turn)."""

    version: int = Field(ge=0)
    run_id: str | None = None
    abort_in_flight: bool = False
