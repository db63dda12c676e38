"""Acknowledged writes that survive a failover: `--redis-wait-replicas N`.

Redis replicates asynchronously: a primary answers a write before its replicas have it, so a primary killed
right after answering takes that write with it, and the replica promoted in its place never saw it. Redis's
`WAIT numreplicas timeout` blocks until the replicas have acknowledged every write made *on the same
connection*. The store's writes go through pooled connections and pipelines, so the barrier here writes one
small key in the run's slot and sends `WAIT` right after it on one connection of the primary owning that
slot: replication is one ordered stream per primary, so replicas that hold the barrier hold every write
answered before it. Fewer than N replicas within the timeout raises `ReplicaWaitError`, a connection error:
the API answers 503 "retry" (writes are idempotent by uid) and a worker retries, so a write is acknowledged
only once N replicas have it.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from rollout_buffer.store import keys

BARRIER_TTL_MS = 60_000


class ReplicaWaitError(RedisConnectionError):
    """Fewer replicas than asked for acknowledged a write in time (or the primary could not be asked)."""


async def _barrier(client: Any, key: str, replicas: int, timeout_ms: int) -> list[Any]:
    """SET `key`, then WAIT, in one pipeline: a pipeline sends its commands on one connection (a cluster
    pipeline on one connection per node), and WAIT counts the writes of the connection that sends it.

    On a cluster, WAIT names no key, so redis-py would send it to every primary (a pipeline refuses that):
    `target_nodes` (a public argument of the cluster pipeline's `execute_command`) pins it to the node the
    SET's slot maps to, so both land in that node's batch. No redirections: a MOVED SET (a failover the
    client has not seen yet) must not be re-sent alone on another connection, which would make the WAIT
    count nothing; it fails the barrier instead and the caller retries."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.set(key, "1", px=BARRIER_TTL_MS)
        if isinstance(client, RedisCluster):
            pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=client.get_node_from_key(key))
            return list(await pipe.execute(raise_on_error=False, allow_redirections=False))
        pipe.execute_command("WAIT", replicas, timeout_ms)
        return list(await pipe.execute(raise_on_error=False))


async def wait_for_replicas(client: Any, run_id: str, replicas: int, timeout_ms: int, *,
                            barrier_key: str | None = None) -> int:
    """Block until `replicas` replicas of the primary holding `run_id`'s slot (or `barrier_key`'s: a key
    outside any run, such as the run index) have every write answered so far; returns how many did. Raises
    `ReplicaWaitError` when fewer did within `timeout_ms`."""
    key = barrier_key or keys.replica_barrier(run_id)
    try:
        results = await _barrier(client, key, replicas, timeout_ms)
    except RedisConnectionError:
        raise
    except RedisError as exc:  # MOVED after a failover, a node gone: the write's fate is unknown, retry
        raise ReplicaWaitError(f"could not wait for replicas of run {run_id!r}: {type(exc).__name__}: {exc}") from exc
    for result in results:
        if isinstance(result, BaseException):
            raise ReplicaWaitError(f"could not wait for replicas of run {run_id!r}: "
                                   f"{type(result).__name__}: {result}") from result
    acked = int(results[1])
    if acked < replicas:
        raise ReplicaWaitError(f"only {acked} of {replicas} replica(s) acknowledged the write within "
                               f"{timeout_ms} ms (--redis-wait-replicas); retry")
    return acked
