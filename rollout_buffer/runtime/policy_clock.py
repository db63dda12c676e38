"""The run's policy version as a worker sees it: what every engine call is stamped with.

The trainer sets it (`policy_version` with its reads, or `POST /policy_version`); it lives in the run's
meta. Every engine call reads it as it starts, so a group admitted right after a version change is stamped
with the new version. Concurrent readers share one HGET in flight (a busy worker pays about one round trip
per round trip, not one per call); `fresh` reads (after an abort) never join one that may predate the change.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from rollout_buffer import keys
from rollout_buffer.versions import as_version


class PolicyClock:
    """The policy version of one run (None while the trainer has not said one); `ttl_s` > 0 caches it."""

    def __init__(self, client: aioredis.Redis, run_id: str, ttl_s: float = 0.0) -> None:
        self.redis = client
        self.run_id = run_id
        self.ttl_s = ttl_s
        self._value: int | None = None
        self._read_at = float("-inf")
        self._pending: asyncio.Future[int | None] | None = None

    async def _read(self) -> int | None:
        raw = await self.redis.hget(keys.run_meta(self.run_id), "policy_version")
        self._value = as_version(raw.decode() if isinstance(raw, bytes) else raw)
        self._read_at = time.monotonic()
        return self._value

    async def current(self, *, fresh: bool = False) -> int | None:
        """The run's policy version now (read afresh when `fresh`)."""
        if fresh:
            return await self._read()
        if time.monotonic() - self._read_at < self.ttl_s:
            return self._value
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._pending)
