"""Failed rollouts of a run, by error type: a count and the first example of each, for `GET /runs/{id}`.

Counts are the run's `rollout_errors:<type>` stats (added atomically when a task ends); the first failed
rollout of each type is kept in `keys.error_examples` (HSETNX, so exactly one writer wins, on any worker).
A trainer or a person looking at a run whose rollouts all fail sees why in one answer, instead of reading
a warning per rollout in a worker's log.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from rollout_buffer.store import keys
from rollout_buffer.store.redis_client import RedisClient

ERROR_STAT_PREFIX = "rollout_errors:"
MAX_EXAMPLE_CHARS = 2000


async def record_example(client: RedisClient, run_id: str, error_type: str, message: str, uid: str) -> bool:
    """Keep `message` as the example of `error_type` unless one is kept already; True if this was the first."""
    blob = orjson.dumps({"message": message[:MAX_EXAMPLE_CHARS], "uid": uid, "at": time.time()})
    return bool(await client.hsetnx(keys.error_examples(run_id), error_type, blob))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def failure_summary(client: RedisClient, run_id: str, stats: dict[str, float]) -> dict[str, Any]:
    """`{"total", "by_type": {type: {"count", "example", "uid", "first_at"}}, "first_error"}`, the types by
    descending count; `first_error` is the earliest example (`{"type", "message", "uid", "at"}`) or None."""
    counts = {name[len(ERROR_STAT_PREFIX):]: int(value) for name, value in stats.items()
              if name.startswith(ERROR_STAT_PREFIX)}
    examples = {_text(k): orjson.loads(v) for k, v in (await client.hgetall(keys.error_examples(run_id))).items()}
    by_type: dict[str, dict[str, Any]] = {}
    for error_type in sorted(set(counts) | set(examples), key=lambda t: (-counts.get(t, 0), t)):
        example = examples.get(error_type) or {}
        by_type[error_type] = {"count": counts.get(error_type, 0), "example": example.get("message"),
                               "uid": example.get("uid"), "first_at": example.get("at")}
    first = min(examples.items(), key=lambda item: item[1].get("at") or 0.0, default=None)
    return {
        "total": sum(counts.values()),
        "by_type": by_type,
        "first_error": None if first is None else {"type": first[0], **first[1]},
    }
