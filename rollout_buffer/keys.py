"""The whole Redis key layout, in one place.

Every key of one run carries the hash tag `{run_id}`, so a run's keys live in one Redis Cluster slot and
the Lua scripts that touch several of them stay legal on a cluster. The few global keys (the run index,
the active-run pointer, remote rollouts) are only ever touched one key per command.

    rb:runs                         hash   run_id -> run config (JSON)               global index
    rb:active_run                   string run_id of the run that unqualified writes attach to
    rb:{R}:meta                     hash   status, created_at, group_size, task_type, ...
    rb:{R}:records                  hash   uid -> packed record (see rollout_buffer.packing)
    rb:{R}:g:{epoch}:{instance_id}  hash   uid -> "1" for every member written so far
    rb:{R}:pending                  zset   group key -> time of its first write (for group timeouts)
    rb:{R}:ready                    list   group keys in completion order, waiting for a reader
    rb:{R}:handed                   set    instance ids whose groups were handed over (resume)
    rb:{R}:skip                     set    instance ids the trainer asked to skip
    rb:{R}:stats                    hash   cumulative counters (writes, duplicates, drops by reason, ...)
    rb:{R}:since                    hash   counters since the previous read (meta_info's no-filter view)
    rb:{R}:tasks                    stream rollout tasks; consumer group "workers"
    rb:{R}:taskstate                hash   task id -> queued | running | done | failed
    rb:{R}:wake                     list   one token per completed group, for long-polling readers
    rb:{R}:closed                   set    group keys already completed, handed over or dropped
    rb:{R}:since_groups             set    groups written to since the previous read (meta_info)
    rb:{R}:timed_out                list   "epoch:instance_id" of groups dropped by the group timeout
    rb:{R}:samples                  hash   instance_id -> input line (JSON), written once by the enqueuer
    rb:{R}:attempts                 hash   task id -> times a worker started it (poison-task cap)
    rb:run_events                   stream run ids launched, so workers anywhere notice new runs (XREAD BLOCK)
    rb:remote:{rollout_id}          hash   state of a remote rollout started by POST /init
    rb:remote:index                 zset   remote rollout ids by start time
    rb:remote_open                  zset   remote rollout ids not yet settled (unfinished or callback undelivered)
    rb:remote_owner:{owner_id}      string liveness lease (with TTL) of the API process running remote rollouts
    rb:{R}:error_examples           hash   error type -> first failed rollout of that type (JSON: message, uid, at)
"""

from __future__ import annotations

PREFIX = "rb"
RUNS = f"{PREFIX}:runs"
ACTIVE_RUN = f"{PREFIX}:active_run"
REMOTE_INDEX = f"{PREFIX}:remote:index"
RUN_EVENTS = f"{PREFIX}:run_events"
WORKER_GROUP = "workers"


def _tag(run_id: str) -> str:
    return f"{PREFIX}:{{{run_id}}}"


def run_meta(run_id: str) -> str:
    return f"{_tag(run_id)}:meta"


def records(run_id: str) -> str:
    return f"{_tag(run_id)}:records"


def group_prefix(run_id: str) -> str:
    return f"{_tag(run_id)}:g:"


def group(run_id: str, epoch: int, instance_id: str) -> str:
    return f"{group_prefix(run_id)}{epoch}:{instance_id}"


def parse_group(run_id: str, key: str) -> tuple[int, str]:
    """(epoch, instance_id) of a group key; instance ids may themselves contain ':'."""
    rest = key[len(group_prefix(run_id)):]
    epoch, _, instance_id = rest.partition(":")
    return int(epoch), instance_id


def pending(run_id: str) -> str:
    return f"{_tag(run_id)}:pending"


def ready(run_id: str) -> str:
    return f"{_tag(run_id)}:ready"


def handed(run_id: str) -> str:
    return f"{_tag(run_id)}:handed"


def skip(run_id: str) -> str:
    return f"{_tag(run_id)}:skip"


def stats(run_id: str) -> str:
    return f"{_tag(run_id)}:stats"


def since(run_id: str) -> str:
    return f"{_tag(run_id)}:since"


def tasks(run_id: str) -> str:
    return f"{_tag(run_id)}:tasks"


def task_state(run_id: str) -> str:
    return f"{_tag(run_id)}:taskstate"


def wake(run_id: str) -> str:
    return f"{_tag(run_id)}:wake"


def closed(run_id: str) -> str:
    return f"{_tag(run_id)}:closed"


def since_groups(run_id: str) -> str:
    return f"{_tag(run_id)}:since_groups"


def timed_out(run_id: str) -> str:
    return f"{_tag(run_id)}:timed_out"


def remote(rollout_id: str) -> str:
    return f"{PREFIX}:remote:{rollout_id}"


# Not under `rb:remote:` so that no rollout_id can collide with them.
REMOTE_OPEN = f"{PREFIX}:remote_open"


def remote_owner(owner_id: str) -> str:
    return f"{PREFIX}:remote_owner:{owner_id}"


def samples(run_id: str) -> str:
    return f"{_tag(run_id)}:samples"


def attempts(run_id: str) -> str:
    return f"{_tag(run_id)}:attempts"


def error_examples(run_id: str) -> str:
    return f"{_tag(run_id)}:error_examples"
