"""The run's policy version as a worker sees it: what every engine call is stamped with.

The trainer sets it (`policy_version` with its reads, or `POST /policy_version`); it lives in the run's
meta, and every change is announced on the run-events stream, from which the worker pool hands it to the
run's clock (`observe`) within milliseconds. So an engine call costs no Redis read; the clock reads the
meta itself only when its value is older than `ttl_s` (a missed announcement is caught up within that),
and afresh after an abort (`fresh`), so a generation continued under a new version is stamped with it.
Concurrent readers share one read in flight; a `fresh` read never joins one that may predate the change.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from rollout_buffer.store import keys
from rollout_buffer.wire.versions import as_version

DEFAULT_TTL_S = 1.0


class PolicyClock:
    """The policy version of one run (None while the trainer has not said one)."""

    def __init__(self, client: aioredis.Redis, run_id: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.redis = client
        self.run_id = run_id
        self.ttl_s = ttl_s
        self._value: int | None = None
        self._read_at = float("-inf")
        self._pending: asyncio.Future[int | None] | None = None

    def observe(self, version: int) -> None:
        """An announced version: the value from now on (until the next announcement or read)."""
        self._value = version
        self._read_at = time.monotonic()

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
