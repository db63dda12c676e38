"""The Redis store: runs, idempotent record writes, group completion, whole-group reads.

All multi-key updates go through the Lua scripts in `rollout_buffer.lua`, so any number of API processes
and workers may share one Redis without double-completing or losing a group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from rollout_buffer import keys, lua
from rollout_buffer.batching import Coalescer, ScriptCall, run_scripts
from rollout_buffer.packing import pack_record, unpack_record

SOCKET_TIMEOUT_S = 30.0
POOL_WAIT_S = 30.0
BLOCKING_SLICE_S = 5.0


@dataclass(frozen=True)
class WriteOutcome:
    """What a write did: `stored`, `completed` (it completed its group), `duplicate`, or `dropped`."""

    outcome: str
    group: str = ""
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return self.outcome in ("stored", "completed", "duplicate")


@dataclass
class ReadGroup:
    run_id: str
    epoch: int
    instance_id: str
    records: list[dict[str, Any]]


@dataclass
class ReadBatch:
    groups: list[ReadGroup] = field(default_factory=list)
    since: dict[str, float] = field(default_factory=dict)
    num_since_groups: int = 0
    timed_out_groups: list[str] = field(default_factory=list)


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _number(value: bytes | str) -> float:
    text = _text(value) or "0"
    number = float(text)
    return int(number) if number.is_integer() and "." not in text else number


class Store:
    """Async access to one Redis for every run."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._write = client.register_script(lua.WRITE_RECORD)
        self._read = client.register_script(lua.READ_READY)
        self._expire = client.register_script(lua.EXPIRE_GROUPS)
        self._writes: Coalescer[ScriptCall, Any] = Coalescer(lambda calls: run_scripts(self.redis, calls))

    @classmethod
    def from_url(cls, url: str, max_connections: int = 128) -> "Store":
        # A blocking pool: under load, callers queue for a connection (up to POOL_WAIT_S) instead of failing
        # with "too many connections". Every Redis call has a time limit; blocking reads wait in slices
        # shorter than it.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_WAIT_S, decode_responses=False,
            health_check_interval=30, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10,
        )
        return cls(aioredis.Redis(connection_pool=pool))

    async def close(self) -> None:
        await self.redis.aclose()

    # ----- runs -------------------------------------------------------------------------------

    async def create_run(self, run_id: str, config: dict[str, Any], *, group_size: int, num_epoch: int,
                         task_type: str) -> bool:
        """Record a run; returns False when it already exists (its stored settings are kept)."""
        created = await self.redis.hsetnx(keys.RUNS, run_id, orjson.dumps(config))
        if created:
            await self.redis.hset(
                keys.run_meta(run_id),
                mapping={
                    "group_size": group_size,
                    "num_epoch": num_epoch,
                    "task_type": task_type,
                    "created_at": time.time(),
                    "status": "running",
                },
            )
        return bool(created)

    async def set_active_run(self, run_id: str) -> None:
        await self.redis.set(keys.ACTIVE_RUN, run_id)

    async def active_run(self) -> str | None:
        return _text(await self.redis.get(keys.ACTIVE_RUN))

    async def run_exists(self, run_id: str) -> bool:
        return bool(await self.redis.hexists(keys.RUNS, run_id))

    async def run_config(self, run_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(keys.RUNS, run_id)
        return orjson.loads(raw) if raw is not None else None

    async def run_meta(self, run_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(keys.run_meta(run_id))
        return {_text(k) or "": _text(v) or "" for k, v in raw.items()}

    async def set_run_status(self, run_id: str, status: str) -> None:
        await self.redis.hset(keys.run_meta(run_id), "status", status)

    async def list_runs(self) -> list[str]:
        return sorted(_text(k) or "" for k in await self.redis.hkeys(keys.RUNS))

    async def add_skip_ids(self, run_id: str, instance_ids: list[str]) -> None:
        if instance_ids:
            await self.redis.sadd(keys.skip(run_id), *instance_ids)

    async def excluded_ids(self, run_id: str) -> set[str]:
        """Instance ids a (re)started run must not roll out: asked to skip, or already handed over."""
        members = await self.redis.sunion([keys.skip(run_id), keys.handed(run_id)])
        return {_text(x) or "" for x in members}

    async def handed_ids(self, run_id: str) -> set[str]:
        return {_text(x) or "" for x in await self.redis.smembers(keys.handed(run_id))}

    async def supersede(self, run_id: str, successor: str, reason: str) -> None:
        """Retire a run in favour of a new generation: its workers stop, readers follow the link."""
        await self.redis.hset(keys.run_meta(run_id), mapping={
            "status": "superseded", "superseded_by": successor, "superseded_reason": reason,
            "superseded_at": time.time()})

    async def incr_stat(self, run_id: str, name: str, amount: int = 1) -> None:
        await self.redis.hincrby(keys.stats(run_id), name, amount)

    async def stats(self, run_id: str) -> dict[str, float]:
        raw = await self.redis.hgetall(keys.stats(run_id))
        return {_text(k) or "": _number(v) for k, v in raw.items()}

    # ----- writes -----------------------------------------------------------------------------

    def _write_call(self, run_id: str, record: dict[str, Any], blob: bytes | None = None
                    ) -> tuple[list[str], list[Any]]:
        """Keys and args of one WRITE_RECORD call; `blob` is the record already packed, if it is."""
        if blob is None:
            blob = pack_record({**record, "run_id": run_id})
        epoch = record.get("epoch")
        write_keys = [
            keys.records(run_id), keys.pending(run_id), keys.ready(run_id), keys.stats(run_id),
            keys.since(run_id), keys.wake(run_id), keys.skip(run_id), keys.closed(run_id),
            keys.run_meta(run_id), keys.since_groups(run_id),
        ]
        args = [
            record["uid"], blob, keys.group_prefix(run_id), record["instance_id"],
            -1 if epoch is None else int(epoch), time.time(), repr(float(record["reward"])),
            record.get("status") or "completed",
        ]
        return write_keys, args

    @staticmethod
    def _outcome(reply: list[Any]) -> WriteOutcome:
        outcome, detail = (_text(x) or "" for x in reply)
        if outcome == "dropped":
            return WriteOutcome(outcome, reason=detail)
        return WriteOutcome(outcome, group=detail)

    async def write_record(self, run_id: str, record: dict[str, Any]) -> WriteOutcome:
        """Store one validated record (idempotent by uid); completes its group atomically. Concurrent
        writes (API requests, rollouts of a worker) share pipelines: `rollout_buffer.batching`."""
        write_keys, args = self._write_call(run_id, record)
        return self._outcome(await self._writes.submit((self._write, write_keys, args)))

    async def write_records(self, run_id: str, records: list[dict[str, Any]],
                            blobs: list[bytes] | None = None) -> list[WriteOutcome]:
        """Many writes in one round trip (a pipeline of the same atomic script), outcomes in order.
        With `blobs`, the records come already packed (with this run_id) and `records` carry only the
        fields the script needs (uid, instance_id, epoch, reward, status)."""
        if not records:
            return []
        calls = [self._write_call(run_id, record, None if blobs is None else blobs[i])
                 for i, record in enumerate(records)]
        replies = await run_scripts(self.redis, [(self._write, write_keys, args) for write_keys, args in calls])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return [self._outcome(reply) for reply in replies]

    # ----- reads ------------------------------------------------------------------------------

    async def read_ready(self, run_id: str, max_samples: int | None = None) -> ReadBatch:
        """Pop whole ready groups in completion order, at most `max_samples` records in all."""
        reply = await self._read(
            keys=[
                keys.ready(run_id), keys.records(run_id), keys.handed(run_id), keys.stats(run_id),
                keys.since(run_id), keys.since_groups(run_id), keys.timed_out(run_id),
            ],
            args=[-1 if max_samples is None else max_samples, keys.group_prefix(run_id)],
        )
        since_flat, num_since_groups, timed_out, *groups = reply
        batch = ReadBatch(
            since={_text(since_flat[i]) or "": _number(since_flat[i + 1]) for i in range(0, len(since_flat), 2)},
            num_since_groups=int(num_since_groups),
            timed_out_groups=[_text(x) or "" for x in timed_out],
        )
        for gkey, pairs in groups:
            epoch, instance_id = keys.parse_group(run_id, _text(gkey) or "")
            records: list[dict[str, Any]] = []
            for i in range(0, len(pairs), 2):
                blob = pairs[i + 1]
                if blob is None:  # cannot happen while every writer uses WRITE_RECORD; counted if it does
                    await self.incr_stat(run_id, "drop:missing_record")
                    continue
                records.append(unpack_record(blob))
            records.sort(key=lambda r: (r.get("timestamp") or 0.0, r["uid"]))
            batch.groups.append(ReadGroup(run_id, epoch, instance_id, records))
        return batch

    async def head_group_size(self, run_id: str) -> int | None:
        """Member count of the oldest ready group, or None when nothing is ready."""
        head = await self.redis.lindex(keys.ready(run_id), 0)
        return None if head is None else int(await self.redis.hlen(_text(head) or ""))

    async def wait_for_ready(self, run_id: str, timeout_s: float) -> bool:
        """Block until a group completes, or at most `timeout_s` (one slice of it); True if one may be ready.
        Callers loop until their own deadline."""
        if await self.redis.llen(keys.ready(run_id)) > 0:
            return True
        if timeout_s <= 0:
            return False
        wait = min(max(timeout_s, 0.01), BLOCKING_SLICE_S)
        try:
            return await self.redis.blpop([keys.wake(run_id)], timeout=wait) is not None
        except aioredis.TimeoutError:
            return False

    async def expire_groups(self, run_id: str, older_than_s: float, policy: str, limit: int = 1000) -> int:
        """Apply the group-timeout policy to incomplete groups; returns how many were closed."""
        return int(
            await self._expire(
                keys=[
                    keys.pending(run_id), keys.ready(run_id), keys.closed(run_id), keys.stats(run_id),
                    keys.wake(run_id), keys.records(run_id), keys.timed_out(run_id),
                ],
                args=[time.time() - older_than_s, policy, limit, keys.group_prefix(run_id)],
            )
        )

    async def group_counts(self, run_id: str) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(keys.pending(run_id))
            pipe.llen(keys.ready(run_id))
            pipe.scard(keys.handed(run_id))
            pending, ready, handed = await pipe.execute()
        return {"pending": int(pending), "ready": int(ready), "handed_instance_ids": int(handed)}
