"""Durable state of remote rollouts in Redis (`rb:remote:{rollout_id}`, see `rollout_buffer.store.keys`).

Every rollout has an `owner`: the API process driving it, alive while its ownership key
`rb:remote_owner:{owner}` exists. All state changes go through one Lua script that checks the owner (and
optionally the status) first, so a process that lost its rollout to a takeover can never move it again,
and the claim of a new rollout_id is one atomic "create if absent". Each script touches one key only, so
this works on Redis Cluster too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from rollout_buffer.remote.drift import Drift
from rollout_buffer.remote.schema import InitRequest
from rollout_buffer.store import keys
from rollout_buffer.store.redis_client import RedisClient

# Create the hash only when absent: the race-free claim of a rollout_id across API processes.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# ARGV: expected owner, new owner, allowed statuses ("a,b"; "" = any), then field/value pairs.
_OWNED_UPDATE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[3] ~= '' then
  local status = redis.call('HGET', KEYS[1], 'status')
  local allowed = false
  for s in string.gmatch(ARGV[3], '[^,]+') do
    if s == status then allowed = true end
  end
  if not allowed then return 0 end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'updated_at', ARGV[4])
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
return 1
"""

UNFINISHED = ("queued", "running")
FINISHED = ("completed", "error")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _flat(fields: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for name, value in fields.items():
        if isinstance(value, (dict, list)):
            value = orjson.dumps(value)
        elif value is None:
            value = ""
        out.extend([name, value])
    return out


class RemoteStates:
    """Owner-checked reads and writes of remote rollout state."""

    def __init__(self, client: RedisClient) -> None:
        self.redis = client
        self._claim = client.register_script(_CLAIM)
        self._update = client.register_script(_OWNED_UPDATE)

    async def claim(self, request: InitRequest, owner: str) -> bool:
        """Record a new rollout as `queued` under `owner`; False when the rollout_id is already known.

        The id enters both indexes first, so a crash right after the claim still leaves it findable by the
        start-up scan (an index entry without state is dropped by the scan)."""
        now = time.time()
        rollout_id = request.rollout_id
        await self.redis.zadd(keys.REMOTE_INDEX, {rollout_id: now}, nx=True)
        await self.redis.zadd(keys.REMOTE_OPEN, {rollout_id: now}, nx=True)
        fields = {"request": request.model_dump(), "status": "queued", "owner": owner, "task_type": request.task_type,
                  "server_url": request.server_url, "created_at": now, "updated_at": now, "attempts": 0,
                  "calls": 0, "turns": 0, "takeovers": 0, "callback_status": "none", "callback_attempts": 0}
        return bool(await self._claim(keys=[keys.remote(rollout_id)], args=_flat(fields)))

    async def get(self, rollout_id: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(keys.remote(rollout_id))
        return {_text(k): _text(v) for k, v in raw.items()} if raw else None

    async def update(self, rollout_id: str, owner: str, *, new_owner: str | None = None,
                     statuses: tuple[str, ...] = (), **fields: Any) -> bool:
        """Set fields if `owner` still owns the rollout (and its status is one of `statuses`, when given)."""
        args = [owner, new_owner or owner, ",".join(statuses), time.time(), *_flat(fields)]
        return bool(await self._update(keys=[keys.remote(rollout_id)], args=args))

    async def incr(self, rollout_id: str, name: str, amount: int = 1) -> int:
        return int(await self.redis.hincrby(keys.remote(rollout_id), name, amount))

    async def record_call(self, rollout_id: str, *, turn: bool, counted: bool, drift: Drift | None) -> None:
        """One finished trainer call: the call and turn counts, and the response mask's drift."""
        key = keys.remote(rollout_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "calls", 1)
            if turn:
                pipe.hincrby(key, "turns", 1)
            if counted:
                pipe.hincrby(key, "mask_counted", 1)
            if drift is not None:
                pipe.hincrby(key, "drift_calls", 1)
                pipe.hincrby(key, "drift_tokens", drift.tokens)
                pipe.hsetnx(key, "drift_first", orjson.dumps(drift.as_dict()))
            await pipe.execute()

    async def open_ids(self, page: int = 500) -> AsyncIterator[tuple[str, float]]:
        """Unsettled rollout ids, oldest first, with the time they entered the index, a page at a time (an
        id settled meanwhile may shift the pages: it is seen on the next scan)."""
        start = 0
        while True:
            rows = await self.redis.zrange(keys.REMOTE_OPEN, start, start + page - 1, withscores=True)
            for row in rows:
                yield _text(row[0]), float(row[1])
            if len(rows) < page:
                return
            start += page

    async def brief(self, rollout_id: str) -> dict[str, str] | None:
        """owner, status and callback_status only (the scan reads these for every open rollout)."""
        values = await self.redis.hmget(keys.remote(rollout_id), ["owner", "status", "callback_status"])
        if values[0] is None and values[1] is None:
            return None
        return {name: _text(v) if v is not None else "" for name, v in zip(("owner", "status", "callback_status"), values)}

    async def settle(self, rollout_id: str, ttl_s: float) -> None:
        """Its callback was delivered (or finally refused): nothing is left to do after a restart, and the
        state expires `ttl_s` from now. (Two keys, so no MULTI: a crash in between leaves the id open, and the
        scan settles it again.)"""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(keys.remote(rollout_id), max(1, int(ttl_s * 1000)))
            pipe.zrem(keys.REMOTE_OPEN, rollout_id)
            await pipe.execute()

    async def prune_index(self, older_than: float, page: int = 500) -> int:
        """Drop index entries that entered before `older_than` and whose state has expired; returns how many."""
        ids = [_text(x) for x in await self.redis.zrangebyscore(keys.REMOTE_INDEX, "-inf", older_than, start=0,
                                                                  num=page)]
        if not ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for rollout_id in ids:
                pipe.exists(keys.remote(rollout_id))
            alive = await pipe.execute()
        gone = [rollout_id for rollout_id, exists in zip(ids, alive) if not exists]
        if gone:
            await self.redis.zrem(keys.REMOTE_INDEX, *gone)
        return len(gone)

    async def heartbeat(self, owner: str, ttl_s: float, info: str) -> None:
        await self.redis.set(keys.remote_owner(owner), info, px=max(1, int(ttl_s * 1000)))

    async def owner_alive(self, owner: str) -> bool:
        return bool(owner) and bool(await self.redis.exists(keys.remote_owner(owner)))

    async def release(self, owner: str) -> None:
        await self.redis.delete(keys.remote_owner(owner))


def public_view(raw: dict[str, str]) -> dict[str, Any]:
    """`GET /init/{rollout_id}`: the state without the stored request and callback bodies."""

    def number(name: str) -> float | None:
        value = raw.get(name)
        return float(value) if value else None

    callback = orjson.loads(raw["callback"]) if raw.get("callback") else None
    request = orjson.loads(raw["request"]) if raw.get("request") else {}
    return {
        "rollout_id": request.get("rollout_id"),
        "status": raw.get("status"),
        "task_type": raw.get("task_type"),
        "server_url": raw.get("server_url"),
        "created_at": number("created_at"),
        "started_at": number("started_at"),
        "finished_at": number("finished_at"),
        "updated_at": number("updated_at"),
        "attempts": int(raw.get("attempts") or 0),
        "takeovers": int(raw.get("takeovers") or 0),
        "error": raw.get("error") or None,
        "reward": number("reward"),
        "counts": {"engine_calls": int(raw.get("calls") or 0), "turns": int(raw.get("turns") or 0),
                   "messages": len(callback["messages"]) if callback else len(request.get("messages") or [])},
        "mask": {"counted_calls": int(raw.get("mask_counted") or 0), "drift_calls": int(raw.get("drift_calls") or 0),
                 "drift_tokens": int(raw.get("drift_tokens") or 0),
                 "first_drift": orjson.loads(raw["drift_first"]) if raw.get("drift_first") else None},
        "callback": {
            "status": raw.get("callback_status") or "none",
            "delivered": raw.get("callback_status") == "delivered",
            "attempts": int(raw.get("callback_attempts") or 0),
            "delivered_at": number("callback_delivered_at"),
            "last_error": raw.get("callback_error") or None,
            "result_status": callback["status"] if callback else None,
        },
    }
