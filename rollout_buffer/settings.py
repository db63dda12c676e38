"""Typed settings: every `serve`/`worker` flag, also settable as `ROLLOUT_BUFFER_<FLAG>`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MAX_DEFAULT_WORKER_PROCESSES = 8


def default_worker_processes() -> int:
    """One worker process per core this process may run on, at most 8: each process is one asyncio loop on
    one core, and past a handful the engine, not the client side, is the limit."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKER_PROCESSES))


class Settings(BaseSettings):
    """Server and worker settings. CLI flags override environment variables, which override defaults."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_BUFFER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8889, ge=0, le=65535)
    data_dir: Path = Path(".rollout-buffer")
    redis_url: str | None = None
    # `redis_url` names any node of a Redis Cluster: the cluster client is used (see rollout_buffer.redis_client).
    redis_cluster: bool = False
    task_dir: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Rollout worker processes: `serve --worker-processes N` runs them beside the API, `rollout-buffer worker
    # --processes N` on any host (default: one per core, at most 8). `serve --worker-processes 0` runs the
    # rollout loops inside the API process instead.
    worker_processes: int = Field(default_factory=default_worker_processes, ge=0, le=64)
    # Rollout loops (stream consumers) per worker process, or in the API process with --worker-processes 0;
    # `serve --workers 0` runs no rollouts at all (API only).
    workers: int = Field(default=1, ge=0, le=64)
    max_body_mb: float = Field(default=64.0, gt=0)
    # Embedded Redis durability: "everysec" survives any process kill (the AOF is written before the
    # reply); "always" also survives a power loss, at the cost of one fsync per write.
    appendfsync: Literal["always", "everysec"] = "everysec"
    # Incomplete groups older than this are handed over or dropped (None = wait for every member).
    group_timeout_s: float | None = Field(default=None, gt=0)
    group_timeout_policy: Literal["hand_over", "drop"] = "drop"
    # Retention: keep at most this many runs (retired ones beyond the newest N are deleted), and delete
    # retired runs this long after they ended. Retired: superseded, failed, or finished with nothing left
    # to read. None = keep.
    retain_runs: int | None = Field(default=None, ge=1)
    run_ttl_s: float | None = Field(default=None, gt=0)
    # A task not acknowledged within this lease is reclaimed by another worker.
    task_lease_s: float = Field(default=600.0, gt=0)
    rollout_timeout_s: float = Field(default=1800.0, gt=0)
    log_level: str = "info"
    # How often the upkeep loop samples each live run's counters for the dashboard's throughput charts.
    timeline_interval_s: float = Field(default=5.0, gt=0)
    # Adds `/_bench/parse_only` (parses a record, stores nothing): the ingest benchmark's baseline.
    bench_routes: bool = False

    @field_validator("task_dir", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p]
        return value

    @model_validator(mode="after")
    def _cluster_needs_a_node_url(self) -> "Settings":
        if not self.redis_cluster:
            return self
        if not self.redis_url:
            raise ValueError("--redis-cluster needs --redis-url naming a node of the cluster "
                             "(redis://host:port); the embedded Redis is a single server")
        parts = urlsplit(self.redis_url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"--redis-cluster needs a redis:// or rediss:// URL (a cluster is reached over TCP), "
                             f"not {self.redis_url!r}")
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError(f"a Redis Cluster has only database 0; --redis-url {self.redis_url!r} names "
                             f"database {parts.path.strip('/')!r}")
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)
