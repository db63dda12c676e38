"""Typed settings: every `serve`/`worker` flag, also settable as `ROLLOUT_BUFFER_<FLAG>`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Server and worker settings. CLI flags override environment variables, which override defaults."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_BUFFER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8889, ge=0, le=65535)
    data_dir: Path = Path(".rollout-buffer")
    redis_url: str | None = None
    task_dir: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # In-process rollout worker loops started by `serve` (0 = none; run `rollout-buffer worker` instead).
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

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)
