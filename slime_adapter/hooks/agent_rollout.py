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
batch; a batch is acknowledged with the next step's first read (slime calls again once it has trained the
batch, and has saved the checkpoint holding its keys when it checkpoints every step), and at once on the
last step (`num_rollout`): a trainer killed while it trains still holds the batch's lease, so the restarted
trainer gets the batch again instead of the buffer rolling out a new generation; one killed after a
checkpoint that holds the batch has it acknowledged by its restart (`rollout_buffer.runs.lifecycle`).
Every read sends the trainer's policy version (`rollout_id`), which the buffer measures staleness
against; the run's bound and group filter (`agent_max_staleness`, `agent_group_filter`) are the buffer's
to enforce, and a step still gets full batches (the buffer replaces what it drops).

slime's data buffer asserts groups of exactly `n_samples_per_prompt` samples: a forked token-path record
keeps only its last piece by default (`agent_fork_policy`, see `AgentRolloutSettings`), and a buffer whose
groups are larger than the trainer asks for raises `GroupSizeMismatchError` at once instead of polling.

A step never waits forever on a run that cannot deliver: `RunFailedError` (`slime_adapter.reading.run_health`)
when too many groups in a row failed entirely or the run has ended with nothing left. With
`min_batch_collection_ratio` below 1 a step may return early (see `AgentRolloutSettings`). With
`evaluation=True` it evaluates instead (`slime_adapter.hooks.evaluation`). When slime has its output classes
the result is a `RolloutFnTrainOutput(samples, metrics)` (`slime_adapter.hooks.outputs`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from slime_adapter.hooks.evaluation import evaluate
from slime_adapter.hooks.metrics import log_raw_info
from slime_adapter.hooks.outputs import slime_outputs_available, train_output
from slime_adapter.hooks.step import SampleBuildError, Step, split_groups
from slime_adapter.hooks.surplus import Surplus
from slime_adapter.reading.buffer_client import (
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
from slime_adapter.reading.lease_renewal import LeaseKeeper
from slime_adapter.reading.run_health import RunFailedError, RunHealth, raise_if_exhausted
from slime_adapter.settings import AgentRolloutSettings

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


@dataclass
class AgentRolloutState:
    """What survives between trainer steps in this process: whether the run was started, its id, and the
    leased batches whose samples are in the data buffer but whose acknowledgement has not reached the
    buffer yet (sent with the next read), and the task renewing their leases meanwhile."""

    started: bool = False
    run_id: str | None = None
    start_answer: dict[str, Any] | None = None
    next_group_index: int = 0
    next_rollout_id: int = 0  # Sample.rollout_id: one per record, shared by its forks
    pending_acks: list[str] = field(default_factory=list)
    health: RunHealth = field(default_factory=RunHealth)
    surplus: Surplus = field(default_factory=Surplus)  # over-sampled groups held for the next step
    leases: LeaseKeeper = field(default_factory=LeaseKeeper)

    def held_batches(self) -> tuple[str | None, list[str]]:
        """(run id, batches held now): read and not acknowledged yet, over-sampled ones included; their
        leases are renewed until acknowledged, between steps too."""
        return self.run_id, list(dict.fromkeys([*self.pending_acks, *self.surplus.read_batches]))


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


def _buffered_groups(data_buffer: Any) -> int:
    """Groups already waiting in slime's buffer (surplus of an earlier step); 0 if it cannot say."""
    length = getattr(data_buffer, "get_buffer_length", None)
    return int(length()) if callable(length) else 0


# the buffer's answer when `num` cannot hold the next ready group (rollout_buffer.runs.reads)
_NUM_TOO_SMALL = re.compile(r"num=(?P<num>\d+) is smaller than the next ready group \((?P<size>\d+) records?\)")


def _check_group_fits(step: "Step", num: int, message: str) -> None:
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
    """Acknowledge the held batches now rather than with the next read (the last step, or a step that reads
    nothing); a failure leaves them to the next read."""
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


def _last_step(args: Any, rollout_id: int) -> bool:
    """Whether this is the trainer's last step (slime's `num_rollout`; unknown: never)."""
    num_rollout = getattr(args, "num_rollout", None)
    return num_rollout is not None and rollout_id >= int(num_rollout) - 1


async def _collect(step: Step, need_groups: int, min_groups: int | None = None) -> None:
    """Fetch until `need_groups` groups were added; empty answers and network errors back off and count
    towards `fetch_trajectory_retry_times` (consecutive; any progress resets the count). A read that got no
    answer is sent again with the same batch id, so the batch it may have leased is not lost. A buffer whose
    next group is larger than `num` raises `GroupSizeMismatchError` at once: waiting cannot fix it.
    Once `min_groups` are in hand, reads stop waiting, and the first one that finds nothing ends the step.
    A run that cannot deliver raises `RunFailedError` (see `slime_adapter.reading.run_health`)."""
    settings, state, failures = step.settings, step.state, 0
    min_groups = need_groups if min_groups is None else min_groups
    where = f"rollout {step.rollout_id}"
    batch_id = _new_batch_id()
    while step.groups_added < need_groups:
        remaining = need_groups - step.groups_added
        num = max(remaining, settings.over_sampling_batch_size or 0) * settings.n_samples_per_prompt
        enough = step.groups_added >= min_groups
        began = time.monotonic()
        error: BaseException | None = None
        message = ""
        acks = [b for b in state.pending_acks if b in step.ackable]
        try:
            records, meta, message = await fetch_rollout_data(
                settings.buffer_url, num, settings.fetch_timeout_s, run_id=state.run_id, lease_s=settings.lease_s,
                batch_id=batch_id, ack=acks, wait_s=0.0 if enough else None, policy_version=step.rollout_id,
                read_format=settings.read_format)
        except RunSuperseded as exc:
            log.warning("rollout %d: %s; reading %s from now on", step.rollout_id, exc, exc.successor)
            state.run_id, state.pending_acks, batch_id = exc.successor, [], _new_batch_id()
            state.surplus.clear()  # its leases went with the old run; the successor hands its groups over again
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error, records, meta = exc, [], {}
        else:
            state.pending_acks = [b for b in state.pending_acks if b not in acks]
            _check_acks(meta)
        if records or meta.get("finished_groups"):
            failures = 0
            read_batch = str(meta["batch_id"]) if meta.get("batch_id") else None
            if read_batch:  # a buffer without leases (slime's own) hands over at once
                # acknowledged once none of its groups is held (step.hand_over); renewed until then, so
                # building, and holding over-sampled groups to the next step, may outlast the lease
                state.surplus.note_read(read_batch)
                state.leases.keep(settings.buffer_url, settings.lease_s, state.held_batches)
                if meta.get("filtered_groups"):
                    # the buffer replaces a batch's filtered groups from the prompt stream once it is
                    # acknowledged: this step's next read acknowledges it, or the step may wait for them
                    step.ackable.add(read_batch)
            try:
                await asyncio.to_thread(step.accept, records, meta, read_batch)  # the loop keeps renewing
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
    (`slime_adapter.hooks.evaluation.evaluate`) and returns slime's eval output instead.

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
    if need <= 0:
        await _flush_acks(settings, state)  # the previous step's batches are trained: no read carries them
    else:
        step = Step(settings=settings, state=state, data_buffer=data_buffer, rollout_id=rollout_id, args=args,
                     need=need)
        try:
            step.hand_over(record_always=False)  # groups held from the previous step's over-sampling come first
            await _collect(step, need, max(0, settings.min_groups_per_step - buffered))
        finally:
            if _last_step(args, rollout_id):  # no next read will carry this step's acks
                await _flush_acks(settings, state)
        metrics = log_raw_info(args, step.metas, rollout_id, step.stats, extra={
            "rollout/group_size_mismatch": step.size_mismatches,
            "rollout/fork_dropped_pieces": step.stats.fork_dropped_pieces,
            "rollout/fork_dropped_tokens": step.stats.fork_dropped_tokens,
            "rollout/fork_dropped_generated_tokens": step.stats.fork_dropped_generated_tokens,
            "rollout/over_sampling_held_groups": len(state.surplus),
        }, to_wandb=not slime_outputs_available(), filter_drops=step.drops.metrics())
    return train_output(data_buffer.get_samples(settings.rollout_batch_size), metrics)


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """slime's synchronous entry point: runs `generate_agent_rollout` on the adapter's own event loop."""
    return _LOOP.run(generate_agent_rollout(args, rollout_id, data_buffer, evaluation))
