"""The run's policy version as a worker sees it: what every engine call is stamped with.

The trainer sets it (`policy_version` with its reads, or `POST /policy_version`); it lives in the run's
meta. A worker reads it at most every `ttl_s` (one HGET, shared by every rollout of the run in this
process), and afresh after an abort, so a generation continued under a new policy is stamped with it.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from rollout_buffer import keys
from rollout_buffer.versions import as_version

DEFAULT_TTL_S = 0.05


class PolicyClock:
    """The cached policy version of one run (None while the trainer has not said one)."""

    def __init__(self, client: aioredis.Redis, run_id: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.redis = client
        self.run_id = run_id
        self.ttl_s = ttl_s
        self._value: int | None = None
        self._read_at = float("-inf")

    async def current(self, *, fresh: bool = False) -> int | None:
        """The run's policy version, at most `ttl_s` old (read now when `fresh`)."""
        now = time.monotonic()
        if fresh or now - self._read_at >= self.ttl_s:
            raw = await self.redis.hget(keys.run_meta(self.run_id), "policy_version")
            self._value = as_version(raw.decode() if isinstance(raw, bytes) else raw)
            self._read_at = now
        return self._value
