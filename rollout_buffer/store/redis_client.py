"""Redis clients: one server (embedded or `--redis-url`) or a Redis Cluster (`--redis-cluster`).

Both clients behave the same for the callers: every command has a time limit, and under load callers
queue for a connection (up to `POOL_WAIT_S`) instead of failing with "too many connections". For one
server that is redis-py's `BlockingConnectionPool`; its async cluster client has no blocking pool (a node
out of connections raises `MaxConnectionsError`), so `BoundedRedisCluster` admits at most `max_connections`
commands or pipelines at a time, each of which holds at most one connection per node.

On a cluster every run key carries the run's hash tag (`rollout_buffer.store.keys`), so each script and each
multi-key command of a run goes to the one node owning that run's slot; global keys are touched one per
command. A cluster that cannot serve part of its slots (a node down, CLUSTERDOWN, TRYAGAIN during a
failover, slots not covered, a connection closed under a command) raises `ClusterUnavailableError`, a
`ConnectionError`: the API answers 503 "retry" and workers retry, as for a single Redis that went away. That
mapping lives in `outage_of` and nowhere else. `check_mode` refuses a URL whose server is not what the settings say (a cluster node without `--redis-cluster` would answer MOVED for most keys; a
single server with it has no cluster to join).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

SOCKET_TIMEOUT_S = 30.0
POOL_WAIT_S = 30.0

RedisClient = aioredis.Redis | RedisCluster
T = TypeVar("T")

# Set while a task holds a permit: the cluster client may call itself (a pipeline re-sends a redirected
# command on its own), and a nested call must not wait for a permit its caller holds.
_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("rollout_buffer_redis_permit", default=False)


class RedisModeError(RuntimeError):
    """The server at the URL is not in the mode the settings ask for (cluster or single)."""


class ClusterUnavailableError(RedisConnectionError):
    """Part of the Redis Cluster cannot serve: to callers, the same as a lost connection."""


# Errors that mean "this part of the cluster cannot answer now". Two of them are redis-py's own bug (read in
# redis-py 8.1.0, the newest release, `redis/asyncio/cluster.py`): on ClusterDownError or SlotNotCoveredError
# `RedisCluster._execute_command` calls `self.aclose()`, which disconnects every connection of every node,
# including those other tasks are in the middle of using. Such a task then writes to a connection whose
# `_writer` is gone: `AttributeError: 'NoneType' object has no attribute 'writelines'` (or `read`, on the
# reply side) from `redis/asyncio/connection.py`, or uvloop's RuntimeError "handler is closed" (redis-py
# expects an OSError there). Neither is a ConnectionError, so without this mapping they answered 500.
_OUTAGES = (ClusterDownError, TryAgainError, SlotNotCoveredError, RuntimeError, AttributeError)


def _inside_redis_py(exc: BaseException) -> bool:
    """Whether `exc` was raised by redis-py's own code (its last frame in the `redis` package)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and f"{os.sep}redis{os.sep}" in last.tb_frame.f_code.co_filename


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` means "Redis (part of the cluster) cannot answer now": retry later, not a bug of ours."""
    if isinstance(exc, RedisConnectionError):
        return True
    if isinstance(exc, RuntimeError):
        return "handler is closed" in str(exc)
    if isinstance(exc, AttributeError):
        return "NoneType" in str(exc) and _inside_redis_py(exc)
    return isinstance(exc, _OUTAGES)


def outage_of(exc: BaseException) -> BaseException:
    """The error callers see for `exc`: outages become `ClusterUnavailableError` (a ConnectionError: 503
    "retry" at the API), the rest stay as they are."""
    if is_outage(exc) and not isinstance(exc, RedisConnectionError):
        error = ClusterUnavailableError(f"Redis unavailable: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    return exc


_is_outage = is_outage
_outage = outage_of


class _Permits:
    """At most `limit` commands in flight; others wait up to `wait_s`, then fail as a lost connection."""

    def __init__(self, limit: int, wait_s: float) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self._semaphore = asyncio.Semaphore(limit)

    async def run(self, make_call: Callable[[], Awaitable[T]]) -> T:
        if _holding.get():
            return await make_call()
        try:
            async with asyncio.timeout(self.wait_s):
                await self._semaphore.acquire()
        except TimeoutError:
            raise RedisConnectionError(f"no Redis Cluster connection free within {self.wait_s:.0f} s "
                                       f"({self.limit} in use)") from None
        token = _holding.set(True)
        try:
            return await make_call()
        finally:
            _holding.reset(token)
            self._semaphore.release()


class BoundedPipeline(ClusterPipeline):
    """A cluster pipeline that takes one permit for its whole execution."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        permits: _Permits = self.cluster_client.permits  # type: ignore[attr-defined]
        try:
            replies = await permits.run(
                lambda: super(BoundedPipeline, self).execute(raise_on_error, allow_redirections))
        except _OUTAGES as exc:
            if not _is_outage(exc):
                raise
            raise _outage(exc) from exc
        return [_outage(reply) if isinstance(reply, Exception) else reply for reply in replies]


class BoundedRedisCluster(RedisCluster):
    """redis-py's async cluster client with callers queueing for connections (see the module docstring)."""

    def __init__(self, *args: Any, max_in_flight: int = 128, wait_s: float = POOL_WAIT_S, **kwargs: Any) -> None:
        # A command or pipeline holds at most one connection per node; a redirected command re-sent by a
        # pipeline may take one more, hence twice the permits per node.
        kwargs["max_connections"] = 2 * max_in_flight
        super().__init__(*args, **kwargs)
        self.permits = _Permits(max_in_flight, wait_s)
        self.sent_once: set[str] = set()  # shas of scripts never re-sent by the client (`send_once`)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] == "EVALSHA" and args[1] in self.sent_once and "target_nodes" not in kwargs \
                and int(args[2]) > 0:
            # redis-py re-sends a command after a connection error unless its node is named: named, it is
            # sent once (MOVED and ASK are still followed: those mean the script did not run)
            if self._initialize:
                await self.initialize()
            kwargs["target_nodes"] = self.get_node_from_key(args[3])
        try:
            return await self.permits.run(lambda: super(BoundedRedisCluster, self).execute_command(*args, **kwargs))
        except _OUTAGES as exc:
            if not _is_outage(exc):
                raise
            raise _outage(exc) from exc

    async def initialize(self, *args: Any, **kwargs: Any) -> "BoundedRedisCluster":
        """Learning the topology fails when no node answers or some slots have no node: an outage."""
        try:
            await super().initialize(*args, **kwargs)
        except RedisConnectionError:
            raise
        except RedisClusterException as exc:
            raise ClusterUnavailableError(f"Redis Cluster unavailable: {exc}") from exc
        return self

    async def ping(self, target_nodes: Any | None = None, **kwargs: Any) -> bool:
        """PING every primary by default (redis-py pings one node): healthy means every slot is served."""
        return bool(await super().ping(target_nodes=target_nodes or RedisCluster.PRIMARIES, **kwargs))

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py, with its message
        return BoundedPipeline(self, transaction)


def send_once(client: RedisClient, script: Any) -> Any:
    """Mark `script` (a registered Script) as one the client must never re-send on its own: a script that is
    not idempotent (it adds to counters) and whose reply was lost ran once already, maybe. Its caller gets
    the connection error instead (503 "retry" at the API). Only the cluster client re-sends (the one-server
    client's connections come from a pool built without retries)."""
    if isinstance(client, BoundedRedisCluster):
        client.sent_once.add(script.sha)
    return script


def connect(url: str, *, cluster: bool = False, max_connections: int = 128) -> RedisClient:
    """A client of the Redis at `url` (any node of it with `cluster`); nothing is sent until first use."""
    options: dict[str, Any] = {"decode_responses": False, "health_check_interval": 30,
                               "socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": 10}
    if cluster:
        return BoundedRedisCluster.from_url(url, max_in_flight=max_connections, wait_s=POOL_WAIT_S, **options)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                    **options)
    return aioredis.Redis(connection_pool=pool)


def display_url(url: str) -> str:
    """`url` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def cluster_enabled(url: str) -> bool:
    """Whether the server at `url` runs in cluster mode (`INFO cluster`: `cluster_enabled:1`)."""
    probe = aioredis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
    try:
        info = await probe.info("cluster")
    finally:
        await probe.aclose()
    return str(info.get("cluster_enabled", 0)) == "1"


async def check_mode(url: str, cluster: bool) -> None:
    """Raise `RedisModeError` (naming the fix) when the server at `url` is not in the mode asked for."""
    enabled = await cluster_enabled(url)
    url = display_url(url)
    if cluster and not enabled:
        raise RedisModeError(f"--redis-cluster is set, but the Redis at {url} is not in cluster mode "
                             f"(cluster_enabled:0): leave --redis-cluster (ROLLOUT_BUFFER_REDIS_CLUSTER) off for "
                             f"a single Redis")
    if enabled and not cluster:
        raise RedisModeError(f"the Redis at {url} is a Redis Cluster node (cluster_enabled:1): add --redis-cluster "
                             f"(or ROLLOUT_BUFFER_REDIS_CLUSTER=1) to use the cluster client")
