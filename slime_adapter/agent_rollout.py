"""slime's rollout function for the agent rollout buffer:
`--rollout-function-path slime_adapter.agent_rollout.generate_rollout`.

Each trainer step pulls whole groups from the buffer until the step has `rollout_batch_size` groups
(`rollout_batch_size * n_samples_per_prompt` samples), builds `Sample`s group by group (the engine's own
tokens when records carry `turns`), hands them to slime's data buffer and returns
`data_buffer.get_samples(rollout_batch_size)`. The first call starts the buffer's run with the group keys
(`"<epoch>:<instance_id>"`) stored in the data buffer's metadata, which is what makes a resume from a
checkpoint roll out exactly the groups it has not trained, in every epoch.

Delivery is exactly-once in effect: every read leases its batch under a batch id this adapter chooses; an
answer lost on the way (timeout, dropped connection) is read again with the same id and gives the same
batch; a batch is acknowledged only once its samples are in the data buffer and its keys in the metadata.
Every read sends the trainer's policy version (`rollout_id`), which the buffer measures staleness
against; the run's bound and group filter (`agent_max_staleness`, `agent_group_filter`) are the buffer's
to enforce, and a step still gets full batches (the buffer replaces what it drops).

slime's data buffer asserts groups of exactly `n_samples_per_prompt` samples: a forked token-path record
keeps only its last piece by default (`agent_fork_policy`, see `AgentRolloutSettings`), and a buffer whose
groups are larger than the trainer asks for raises `GroupSizeMismatchError` at once instead of polling.

A step never waits forever on a run that cannot deliver: `RunFailedError` (`slime_adapter.run_health`)
when too many groups in a row failed entirely or the run has ended with nothing left. With
`min_batch_collection_ratio` below 1 a step may return early (see `AgentRolloutSettings`). With
`evaluation=True` it evaluates instead (`slime_adapter.evaluation`). When slime has its output classes
the result is a `RolloutFnTrainOutput(samples, metrics)` (`slime_adapter.outputs`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from slime_adapter.buffer_client import (
    BufferUnavailableError,
    RunSuperseded,
    StartRolloutRejected,
    ack_batches,
    build_start_payload,
    fetch_rollout_data,
    get_rollout_data,
    skip_ids_from_metadata,
    start_rollout,
)
from slime_adapter.build import BuildStats, build_group_samples
from slime_adapter.evaluation import evaluate
from slime_adapter.lease_renewal import LeaseKeeper
from slime_adapter.metrics import log_raw_info
from slime_adapter.outputs import slime_outputs_available, train_output
from slime_adapter.run_health import RunFailedError, RunHealth, raise_if_exhausted
from slime_adapter.settings import AgentRolloutSettings
from slime_adapter.tokenizers import get_tokenizer

__all__ = [
    "AgentRolloutState",
    "BufferUnavailableError",
    "GroupSizeMismatchError",
    "RolloutDataUnavailable",
    "RunFailedError",
    "RunSuperseded",
    "SampleBuildError",
    "StartRolloutRejected",
    "build_start_payload",
    "generate_agent_rollout",
    "generate_rollout",
    "get_rollout_data",
    "get_state",
    "log_raw_info",
    "reset_state",
    "skip_ids_from_metadata",
    "split_groups",
    "start_rollout",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutDataUnavailable(RuntimeError):
    """More consecutive empty or failed fetches than `fetch_trajectory_retry_times` allows."""


class GroupSizeMismatchError(RuntimeError):
    """The buffer's groups are larger than the `num` this step asks for: the buffer's run groups more
    samples per prompt than the trainer's `n_samples_per_prompt`. Polling again cannot help."""

    def __init__(self, message: str, group_size: int | None, n_samples_per_prompt: int) -> None:
        super().__init__(message)
        self.group_size = group_size
        self.n_samples_per_prompt = n_samples_per_prompt


class SampleBuildError(RuntimeError):
    """A handed-over group could not be turned into exact samples; `records` keeps it for inspection."""

    def __init__(self, message: str, records: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.records = records


@dataclass
class AgentRolloutState:
    """What survives between trainer steps in this process: whether the run was started, its id, and the
    leased batches whose samples are in the data buffer but whose acknowledgement has not reached the
    buffer yet (sent with the next read), and the task renewing their leases meanwhile."""

    started: bool = False
    run_id: str | None = None
    start_answer: dict[str, Any] | None = None
    next_group_index: int = 0
    pending_acks: list[str] = field(default_factory=list)
    health: RunHealth = field(default_factory=RunHealth)
    leases: LeaseKeeper = field(default_factory=LeaseKeeper)


_STATE = AgentRolloutState()


def get_state() -> AgentRolloutState:
    """The process-wide adapter state (one trainer process drives one run)."""
    return _STATE


def reset_state() -> AgentRolloutState:
    """Forget the started run, as a fresh trainer process would (the next step calls /start_rollout again)."""
    global _STATE
    _STATE.leases.stop()
    _STATE = AgentRolloutState()
    return _STATE


class _LoopThread:
    """One event loop in a daemon thread, reused by every step: the trainer calls `generate_rollout`
    synchronously, possibly from a thread that already runs a loop, where `asyncio.run` would fail."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="agent-rollout-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure()).result()


_LOOP = _LoopThread()


def split_groups(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records of one read, grouped by (instance_id, epoch), in the order the buffer handed them over."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((str(record["instance_id"]), record.get("epoch")), []).append(record)
    return list(groups.values())


def _buffered_groups(data_buffer: Any) -> int:
    """Groups already waiting in slime's buffer (surplus of an earlier step); 0 if it cannot say."""
    length = getattr(data_buffer, "get_buffer_length", None)
    return int(length()) if callable(length) else 0


@dataclass
class _Step:
    """One trainer step's fetch: reads' meta_info, finished ids, build counts."""

    settings: AgentRolloutSettings
    state: AgentRolloutState
    data_buffer: Any
    rollout_id: int
    metas: list[dict[str, Any]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # group keys "<epoch>:<instance_id>"
    finished_ids: list[str] = field(default_factory=list)  # from a buffer that names no keys (slime's own)
    stats: BuildStats = field(default_factory=BuildStats)
    groups_added: int = 0
    size_mismatches: int = 0

    def __post_init__(self) -> None:
        earlier = (self.data_buffer.get_metadata() or {}).get(self._key)
        if isinstance(earlier, dict):  # this step was interrupted and is being retried: keep what it consumed
            self.finished = [str(k) for k in earlier.get("groups") or []]
            self.finished_ids = [str(i) for i in earlier.get("instance_ids") or []]

    @property
    def _key(self) -> str:
        return str(self.rollout_id)

    def _tokenizer(self) -> Any:
        if not self.settings.hf_checkpoint:
            raise ValueError("a record without `turns` needs a tokenizer to re-render its messages; "
                             "set args.hf_checkpoint")
        return get_tokenizer(self.settings.hf_checkpoint, trust_remote_code=True)

    def _build(self, records: list[dict[str, Any]]) -> list[Any]:
        group_index = self.state.next_group_index
        samples, stats = build_group_samples(records, self._tokenizer, self.settings.loss_mask_type,
                                             group_index=group_index, fork_policy=self.settings.fork_policy,
                                             verify=self.settings.loss_mask_verify,
                                             mask_offpolicy=self.settings.mask_offpolicy)
        has_raw = {r["uid"]: r.get("raw_reward") is not None for r in records}
        for sample in samples:
            if self.settings.reward_field(has_raw[sample.metadata["uid"]]) == "raw_reward":
                sample.reward = sample.metadata["raw_reward"]
        self.state.next_group_index += 1
        self.stats.merge(stats)
        if len(samples) != self.settings.n_samples_per_prompt:
            self.size_mismatches += 1
            log.warning("group of instance %s has %d sample(s), n_samples_per_prompt is %d (forks: %d, "
                        "agent_fork_policy %r); slime's group reward normalisation and "
                        "RolloutDataSourceWithBuffer.add_samples assume groups of exactly n_samples_per_prompt",
                        records[0]["instance_id"], len(samples), self.settings.n_samples_per_prompt, stats.forks,
                        self.settings.fork_policy)
        return samples

    def accept(self, records: list[dict[str, Any]], meta: dict[str, Any]) -> int:
        """Build and store one read's groups; returns how many groups went into the data buffer.

        Everything the read consumed is recorded in the metadata before any error propagates, and every
        group built before a failing one is already in the data buffer.
        """
        if meta:
            self.metas.append(meta)
        if "finished_group_keys" in meta:
            self.finished.extend(str(k) for k in meta["finished_group_keys"])
        else:  # slime's form: one instance id per group (see buffer_client.resume_keys_from_metadata)
            self.finished_ids.extend(str(i) for i in meta.get("finished_groups") or [])
        built: list[list[Any]] = []
        try:
            for group in split_groups(records):
                try:
                    built.append(self._build(group))
                except Exception as exc:
                    raise SampleBuildError(f"cannot build samples for the group of instance "
                                           f"{group[0]['instance_id']}: {type(exc).__name__}: {exc}", group) from exc
        finally:
            record: dict[str, list[str]] = {"groups": list(self.finished)}
            if self.finished_ids:
                record["instance_ids"] = list(self.finished_ids)
            self.data_buffer.update_metadata({self._key: record})
            if built:
                self.data_buffer.add_samples(built)
                self.groups_added += len(built)
        return len(built)


# the buffer's answer when `num` cannot hold the next ready group (rollout_buffer.runs.reads)
_NUM_TOO_SMALL = re.compile(r"num=(?P<num>\d+) is smaller than the next ready group \((?P<size>\d+) records?\)")


def _check_group_fits(step: "_Step", num: int, message: str) -> None:
    """Raise at once when the buffer refused because `num` is smaller than its next ready group."""
    match = _NUM_TOO_SMALL.search(message)
    if match is None and not ("smaller than" in message and "group" in message):
        return
    n = step.settings.n_samples_per_prompt
    size = int(match["size"]) if match else None
    described = f"has {size} samples" if size is not None else "is larger than that"
    raise GroupSizeMismatchError(
        f"rollout {step.rollout_id}: the buffer's next ready group {described}, but this step asked for "
        f"num={num} ({num // n} group(s) x n_samples_per_prompt={n}); the buffer's run groups "
        f"{size if size is not None else 'more'} samples per prompt (its num_repeat_per_sample) while the "
        f"trainer expects n_samples_per_prompt={n}. Make them equal (start the buffer's run with "
        f"num_repeat_per_sample={n}, or set n_samples_per_prompt to the buffer's group size). "
        f"Buffer said: {message!r}", size, n)


def _backoff_s(settings: AgentRolloutSettings, failures: int) -> float:
    return min(settings.fetch_backoff_max_s, settings.fetch_backoff_s * 2 ** max(0, failures - 1))


async def _ensure_started(settings: AgentRolloutSettings, state: AgentRolloutState, args: Any,
                          data_buffer: Any, rollout_id: int) -> None:
    if state.started:
        return
    metadata = data_buffer.get_metadata() or {}
    answer = await asyncio.to_thread(functools.partial(start_rollout, settings.buffer_url, args, metadata,
                                                       policy_version=rollout_id))
    state.started, state.run_id, state.start_answer = True, answer.get("run_id"), answer


def _new_batch_id() -> str:
    return uuid.uuid4().hex


def _check_acks(meta: dict[str, Any]) -> None:
    for result in meta.get("acks") or []:
        if result.get("outcome") not in ("acked", "already_acked"):
            log.warning("acknowledging batch %s: %s (its groups may be handed over again)", result.get("batch_id"),
                        result.get("outcome"))


async def _flush_acks(settings: AgentRolloutSettings, state: AgentRolloutState) -> None:
    """Acknowledge the batches this step took, now rather than with the next step's first read."""
    if not state.pending_acks:
        return
    sent = list(state.pending_acks)
    try:
        outcomes = await ack_batches(settings.buffer_url, sent, run_id=state.run_id)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.warning("acknowledging %d batch(es) failed (%s); retried with the next read", len(sent), exc)
        return
    state.pending_acks = [b for b in state.pending_acks if b not in sent]
    _check_acks({"acks": [{"batch_id": b, "outcome": o} for b, o in outcomes.items()]})


async def _collect(step: _Step, need_groups: int, min_groups: int | None = None) -> None:
    """Fetch until `need_groups` groups were added; empty answers and network errors back off and count
    towards `fetch_trajectory_retry_times` (consecutive; any progress resets the count). A read that got no
    answer is sent again with the same batch id, so the batch it may have leased is not lost. A buffer whose
    next group is larger than `num` raises `GroupSizeMismatchError` at once: waiting cannot fix it.
    Once `min_groups` are in hand, reads stop waiting, and the first one that finds nothing ends the step.
    A run that cannot deliver raises `RunFailedError` (see `slime_adapter.run_health`)."""
    settings, state, failures = step.settings, step.state, 0
    min_groups = need_groups if min_groups is None else min_groups
    where = f"rollout {step.rollout_id}"
    batch_id = _new_batch_id()
    while step.groups_added < need_groups:
        remaining = need_groups - step.groups_added
        num = remaining * settings.n_samples_per_prompt
        enough = step.groups_added >= min_groups
        began = time.monotonic()
        error: BaseException | None = None
        message = ""
        acks = list(state.pending_acks)
        try:
            records, meta, message = await fetch_rollout_data(
                settings.buffer_url, num, settings.fetch_timeout_s, run_id=state.run_id, lease_s=settings.lease_s,
                batch_id=batch_id, ack=acks, wait_s=0.0 if enough else None, policy_version=step.rollout_id,
                read_format=settings.read_format)
        except RunSuperseded as exc:
            log.warning("rollout %d: %s; reading %s from now on", step.rollout_id, exc, exc.successor)
            state.run_id, state.pending_acks, batch_id = exc.successor, [], _new_batch_id()
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error, records, meta = exc, [], {}
        else:
            state.pending_acks = [b for b in state.pending_acks if b not in acks]
            _check_acks(meta)
        if records or meta.get("finished_groups"):
            failures = 0
            # acknowledged even when building fails (its keys are in the metadata: the batch is consumed);
            # its lease is renewed meanwhile, so building may take longer than the lease
            if meta.get("batch_id"):  # a buffer without leases (slime's own) hands over at once
                state.pending_acks.append(str(meta["batch_id"]))
                state.leases.keep(settings.buffer_url, settings.lease_s,
                                  lambda: (state.run_id, list(state.pending_acks)))
            try:
                await asyncio.to_thread(step.accept, records, meta)  # the loop keeps renewing meanwhile
            finally:
                batch_id = _new_batch_id()
            state.health.observe(meta)
            await state.health.check(settings.buffer_url, state.run_id, settings.max_failed_groups, where)
            continue
        _check_group_fits(step, num, message)
        if enough and error is None:
            log.info("%s: %d group(s) in hand (min_batch_collection_ratio %g) and none ready; returning early",
                     where, step.groups_added, settings.min_batch_collection_ratio)
            return
        if error is None:
            await raise_if_exhausted(settings.buffer_url, state.run_id,
                                     f"{where} ({step.groups_added}/{need_groups} group(s) in hand)")
        failures += 1
        reason = f"{type(error).__name__}: {error}" if error else "no group ready" + (
            f" (buffer: {message})" if message else "")
        if 0 <= settings.fetch_retry_times < failures:
            raise RolloutDataUnavailable(
                f"rollout {step.rollout_id}: {failures} consecutive fetch(es) from {settings.buffer_url} got no "
                f"data (last: {reason}); {step.groups_added}/{need_groups} group(s) in hand, kept in the data "
                "buffer") from error
        delay = _backoff_s(settings, failures) - (time.monotonic() - began)
        log.info("rollout %d: %s; %d/%d group(s) in hand, retrying", step.rollout_id, reason,
                 step.groups_added, need_groups)
        if delay > 0:
            await asyncio.sleep(delay)


async def generate_agent_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """One trainer step (see the module docstring); returns `data_buffer.get_samples(rollout_batch_size)`,
    as `RolloutFnTrainOutput(samples, metrics)` when slime has that class. `evaluation=True` evaluates
    (`slime_adapter.evaluation.evaluate`) and returns slime's eval output instead.

    Groups beyond what the step needs stay in `data_buffer` for the next step. Filtered groups (in
    `meta_info.finished_groups` but not in the data) are still recorded as finished for resume.
    """
    if evaluation:
        return await evaluate(args, rollout_id)
    settings = AgentRolloutSettings.from_args(args)
    state = _STATE
    await _ensure_started(settings, state, args, data_buffer, rollout_id)
    buffered = _buffered_groups(data_buffer)
    need = settings.rollout_batch_size - buffered
    metrics: dict[str, Any] | None = None
    if need > 0:
        step = _Step(settings=settings, state=state, data_buffer=data_buffer, rollout_id=rollout_id)
        try:
            await _collect(step, need, max(0, settings.min_groups_per_step - buffered))
        finally:
            await _flush_acks(settings, state)
        metrics = log_raw_info(args, step.metas, rollout_id, step.stats, extra={
            "rollout/group_size_mismatch": step.size_mismatches,
            "rollout/fork_dropped_pieces": step.stats.fork_dropped_pieces,
            "rollout/fork_dropped_tokens": step.stats.fork_dropped_tokens,
            "rollout/fork_dropped_generated_tokens": step.stats.fork_dropped_generated_tokens,
        }, to_wandb=not slime_outputs_available())
    return train_output(data_buffer.get_samples(settings.rollout_batch_size), metrics)


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """slime's synchronous entry point: runs `generate_agent_rollout` on the adapter's own event loop."""
    return _LOOP.run(generate_agent_rollout(args, rollout_id, data_buffer, evaluation))
