"""Which Redis a test's buffer server runs on: the embedded one, an external one (`REDIS_URL` when set,
else a plain `redis-server` the session starts itself: the `external_redis` fixture), or the session's real
3-node Redis Cluster (`redis_cluster` fixture, `tests/support/redis_cluster.py`). Every backend runs with or without
`REDIS_URL`, so the README's test command and CI run the same tests.

The cluster is shared by the whole session, one server at a time: a backend flushes it before a server
starts on it, and `LocalRedisCluster.flush` refuses while an earlier server or store is still attached.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from tests.support.helpers import ServerProcess
from tests.support.redis_cluster import LocalRedisCluster


def _own_database(url: str | None) -> str | None:
    """Under pytest-xdist each worker process takes a database of its own (its number) on the external
    Redis, so key-count checks see only their own worker's keys."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not url or not worker.startswith("gw"):
        return url
    return urlunsplit(urlsplit(url)._replace(path=f"/{int(worker[2:])}"))


def external_url_from_env() -> str | None:
    """CI's external Redis (`REDIS_URL`), this worker's database of it; None when unset."""
    return _own_database(os.environ.get("REDIS_URL"))


# The Redis-facing tests run on each of these (a fixture parameter).
BACKENDS = ["embedded", "external", "cluster"]
# Slow end-to-end tests run on the embedded Redis and the cluster only (the external single Redis is the
# embedded one's code path with another URL).
CLUSTER_BACKENDS = ["embedded", "cluster"]


@dataclass
class Backend:
    name: str
    cluster: LocalRedisCluster | None = None
    url: str | None = None  # the external Redis

    def server_args(self) -> list[str]:
        """`rollout-buffer serve`/`worker` flags for this Redis (none: the server's own embedded one)."""
        if self.name == "external":
            assert self.url
            return ["--redis-url", self.url]
        if self.cluster is not None:
            return ["--redis-url", self.cluster.url, "--redis-cluster"]
        return []

    def keys(self, server: ServerProcess) -> list[bytes]:
        """Every key in `server`'s Redis."""
        if self.cluster is not None:
            return self.cluster.keys()
        if self.name == "external":
            with redis.Redis.from_url(self.url or "") as client:
                return list(client.keys("*"))
        with redis.Redis(unix_socket_path=str((server.cwd / server.data_dir / "redis.sock").resolve())) as client:
            return list(client.keys("*"))


def backend(request: pytest.FixtureRequest, name: str | None = None) -> Backend:
    """The backend named by `name` (default: `request.param`); the cluster is flushed for the server about
    to start on it."""
    name = str(request.param) if name is None else name
    if name == "external":
        return Backend(name, url=str(request.getfixturevalue("external_redis")))
    if name != "cluster":
        return Backend(name)
    cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    cluster.flush()
    return Backend(name, cluster)


def shared_redis_args(server: ServerProcess) -> list[str]:
    """Flags that point another process at the same Redis as `server`."""
    if "--redis-url" in server.args:
        at = server.args.index("--redis-url")
        return [*server.args[at:at + 2], *(["--redis-cluster"] if "--redis-cluster" in server.args else [])]
    return ["--redis-url", f"unix://{(server.cwd / server.data_dir / 'redis.sock').resolve()}"]
