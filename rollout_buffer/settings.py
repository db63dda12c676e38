"""Typed settings: every `serve`/`worker` flag, also settable as `ROLLOUT_BUFFER_<FLAG>`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MAX_TASKS_PER_RUN = 10_000_000
MAX_DEFAULT_WORKER_PROCESSES = 8
MAX_DEFAULT_API_PROCESSES = 8
AGENT_SANDBOXES = ("bwrap", "docker", "local")  # built-in backends (rollout_buffer.agents.sandbox.BACKENDS)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_worker_processes() -> int:
    """One worker process per core this process may run on, at most 8: each process is one asyncio loop on
    one core, and past a handful the engine, not the client side, is the limit."""
    return min(usable_cores(), MAX_DEFAULT_WORKER_PROCESSES)


def default_api_processes() -> int:
    """One API process per core, at most 8: one process is one event loop on one core, and a gateway turn
    costs about a millisecond of it, so one process tops out at a few hundred turns per second."""
    return min(usable_cores(), MAX_DEFAULT_API_PROCESSES)


class Settings(BaseSettings):
    """Server and worker settings. CLI flags override environment variables, which override defaults."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_BUFFER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8889, ge=0, le=65535)
    data_dir: Path = Path(".rollout-buffer")
    redis_url: str | None = None
    # `redis_url` names any node of a Redis Cluster: the cluster client is used (see rollout_buffer.store.redis_client).
    redis_cluster: bool = False
    # Every acknowledged write, leased read and ack waits until this many replicas have it (Redis `WAIT`), so a
    # failover that promotes a replica loses none of them (rollout_buffer.store.replication); 0 = do not wait.
    redis_wait_replicas: int = Field(default=0, ge=0, le=16)
    task_dir: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Rollout worker processes: `serve --worker-processes N` runs them beside the API, `rollout-buffer worker
    # --processes N` on any host (default: one per core, at most 8). `serve --worker-processes 0` runs the
    # rollout loops inside the API process instead.
    worker_processes: int = Field(default_factory=default_worker_processes, ge=0, le=64)
    # API processes serving one port (rollout_buffer.api.processes, docs/scaling.md): any of them serves any
    # session, run or read, as all state lives in Redis (default: one per core, at most 8; 1 = the API in the
    # `serve` process itself, as before).
    api_processes: int = Field(default_factory=default_api_processes, ge=1, le=64)
    # Rollout loops (stream consumers) per worker process, or in the API process with --worker-processes 0;
    # `serve --workers 0` runs no rollouts at all (API only).
    workers: int = Field(default=1, ge=0, le=64)
    max_body_mb: float = Field(default=64.0, gt=0)
    # Per route family (rollout_buffer.api.body_limits), each capped by max_body_mb: the model endpoints (/v1/...)
    # and the control routes (/start_rollout, reads, acks, sessions, /init).
    max_gateway_body_mb: float = Field(default=16.0, gt=0)
    max_control_body_mb: float = Field(default=16.0, gt=0)
    # The gateway as worker hosts reach it (the balancer in front of the API processes, https where the operator
    # uses TLS): sandbox model relays and in-process agents use it instead of the run's remote_buffer_url, the
    # address /start_rollout happened to arrive on (docs/scaling.md). None = that address.
    gateway_url: str | None = None
    # the disk budget of task images the buffer pulled or built into this host's Engine (least recently used go)
    image_cache_mb: float | None = Field(default=None, gt=0)
    # A gateway turn whose prompt is longer is refused (400) before it reaches the engine; a conversation whose
    # text is more than 16 characters per allowed token is refused before it is rendered.
    max_prompt_tokens: int = Field(default=262_144, ge=1)
    # Gateway session caps (rollout_buffer.api.gateway.session_caps): one session's turns, forks and stored MB
    # (409 at the cap), and sessions open at once in one run and in the server (429 with Retry-After).
    max_session_turns: int = Field(default=1000, ge=1)
    max_session_forks: int = Field(default=100, ge=0)
    max_session_mb: float = Field(default=256.0, gt=0)
    max_open_sessions_per_run: int = Field(default=10_000, ge=1)
    max_open_sessions: int = Field(default=50_000, ge=1)
    # Slow clients (rollout_buffer.api.slow_clients): a connection whose request headers are not complete this
    # long after it opened (or after the request's first byte) is closed; at most this many connections are
    # held (None: three quarters of the open-file limit, at most 4096), then the oldest one still waiting for
    # its headers is closed, or the new one answered 503.
    header_timeout_s: float = Field(default=5.0, gt=0, le=300)
    max_connections: int | None = Field(default=None, ge=1)
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
    # A job (one rollout of the stream) whose worker has not renewed its claim for this long is reclaimed by
    # another worker. The name, `--task-lease-s`, is kept: operators' command lines use it.
    task_lease_s: float = Field(default=600.0, gt=0)
    rollout_timeout_s: float = Field(default=1800.0, gt=0)
    # A gateway session (docs/gateway.md) idle this long is finished as failed (counted).
    session_timeout_s: float = Field(default=600.0, gt=0)
    log_level: str = "info"
    # OpenTelemetry: export a trace per rollout to this OTLP/HTTP endpoint (rollout_buffer.metrics.tracing);
    # None: the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables, else no tracing at all.
    otlp_endpoint: str | None = None
    # How often the upkeep loop samples each live run's counters for the dashboard's throughput charts.
    timeline_interval_s: float = Field(default=5.0, gt=0)
    # Network safety (docs/security.md). With a token, every route but /health needs
    # `Authorization: Bearer <token>`; `auth_token_file` reads it from a file (first line) instead.
    auth_token: SecretStr | None = None
    auth_token_file: Path | None = None
    # Folders whose files `input_file` and local `tokenizer_path`s may name (symlinks resolved); empty =
    # the directory the server started in.
    input_root: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # URL prefixes the server may call (engine URLs, /init server_url and its callback); empty = any.
    allow_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A tokenizer name that is not a local folder is looked up in the Hugging Face cache only, unless this
    # is set (then missing files are downloaded from the hub).
    allow_hub_downloads: bool = False
    # Largest task count (input lines x num_epoch x num_repeat_per_sample) one run may enqueue.
    max_tasks_per_run: int = Field(default=DEFAULT_MAX_TASKS_PER_RUN, ge=1)
    # Sandbox backends `agent_command` runs may use (docs/sandboxes.md): bwrap, docker, local or
    # "pkg.module:factory". Empty (the default): agent commands are off, and such a run is refused 403.
    agent_sandbox: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Hosts a sandbox phase may reach through its egress proxy (docs/harbor.md, "Network"): host, host:port or
    # *.domain. The agent's phase reaches nothing but the model by default; the verifier's only these hosts.
    egress_agent: Annotated[list[str], NoDecode] = Field(default_factory=list)
    egress_verifier: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Hosts a Harbor task's image build reaches through an egress proxy (none: the build has no network).
    egress_build: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # An upstream HTTP proxy (http://host:port) that dials for the egress proxies (which stay the filter).
    egress_proxy: str | None = None
    # An image with python3 in which every docker sandbox runs its model and egress forwarders, in a holder
    # container whose network the sandbox joins (rollout_buffer.agents.docker_holder): task images then need none.
    forwarder_image: str | None = Field(default=None, min_length=1)
    # Allowed hosts served by the operator's mirror: `host=addr:port` or `host:port=addr:port` (the host is still
    # checked by its own name; the egress proxy dials the mirror instead, rollout_buffer.agents.egress.Mirrors).
    egress_mirror: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # The largest memory_mb / storage_mb a Harbor task.toml may ask for (a larger one is refused at /start_rollout,
    # rollout_buffer.tasks.harbor_toml); None = the host's physical memory, and 102400 MB of storage.
    harbor_max_memory_mb: int | None = Field(default=None, ge=1)
    harbor_max_storage_mb: int | None = Field(default=None, ge=1)
    # Harbor task folders reach worker hosts through the run (rollout_buffer.runtime.task_folders): a folder
    # larger than this, or a run's folders together larger than the second, is refused (413) at /start_rollout.
    task_folder_max_mb: float = Field(default=64.0, gt=0)
    task_folders_max_mb: float = Field(default=1024.0, gt=0)
    # A worker uses the folder at the dataset's path when it matches the run's copy ("auto"), or always the run's
    # copy ("fetch"), fetched into this host's cache (None: ~/.cache/rollout-buffer/task-folders).
    task_folders: Literal["auto", "fetch"] = "auto"
    task_folder_cache: Path | None = None
    # Capacity per worker host (rollout_buffer.runtime.capacity): the host's name in the fleet (None: its hostname),
    # its budget (None: its usable cores and physical memory; sandboxes unbounded), how long a task no host can
    # hold waits before it fails as no_host_fits, and sandboxes started per second on the host (None: no limit).
    host_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    host_cpus: float | None = Field(default=None, gt=0)
    host_memory_mb: int | None = Field(default=None, ge=1)
    host_sandboxes: int | None = Field(default=None, ge=1)
    capacity_wait_s: float = Field(default=600.0, gt=0)
    sandbox_create_rate: float | None = Field(default=None, gt=0)
    # A host whose Engine fails this many sandbox creations in a row is paused for the back-off (doubled after each
    # failed probe, at most 10 minutes); its rollouts are returned for other hosts (rollout_buffer.runtime.host_health).
    host_pause_after: int = Field(default=3, ge=1)
    host_pause_s: float = Field(default=30.0, gt=0)
    # Host header names the server answers to (DNS rebinding guard, rollout_buffer.api.browser_guard); empty =
    # the bound name, `localhost` names, and the machine's own names on a non-loopback bind; IP literals always
    # pass; "*" = any.
    allowed_host: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Web page origins allowed to call the API from a browser (CORS); none by default.
    cors_origin: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # The trajectory archive (docs/archive.md): every run's finalized records as Parquet shards in
    # `<archive_dir>/<run_id>/` (a run may opt out, or name a folder of its own); None = only runs that name
    # a folder archive. Shards are written every `archive_interval_s`, at most `archive_shard_records` each.
    archive_dir: Path | None = None
    archive_interval_s: float = Field(default=1.0, gt=0, le=3600)
    archive_shard_records: int = Field(default=1000, ge=1, le=1_000_000)

    @field_validator("task_dir", "input_root", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p]
        return value

    @model_validator(mode="after")
    def _replicas_need_a_redis(self) -> "Settings":
        if self.redis_wait_replicas and not self.redis_url:
            raise ValueError("--redis-wait-replicas needs --redis-url naming a Redis with replicas; the embedded "
                             "Redis has none")
        return self

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

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"--gateway-url {value!r}: give http(s)://host[:port][/prefix], the address worker "
                             f"hosts reach the gateway at")
        return value.strip().rstrip("/")

    @field_validator("agent_sandbox")
    @classmethod
    def _known_sandboxes(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in AGENT_SANDBOXES and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", name):
                raise ValueError(f"--agent-sandbox {name!r}: give bwrap, docker, local or 'package.module:factory'")
        return list(dict.fromkeys(value))

    @field_validator("egress_agent", "egress_verifier", "egress_build")
    @classmethod
    def _egress_hosts(cls, value: list[str]) -> list[str]:
        for host in value:  # the syntax `rollout_buffer.agents.egress.Allowlist` reads
            if not re.fullmatch(r"(\*\.)?[A-Za-z0-9._-]+(:\d{1,5})?", host):
                raise ValueError(f"egress host {host!r}: give host, host:port or *.domain")
        return value

    @field_validator("egress_mirror")
    @classmethod
    def _egress_mirrors(cls, value: list[str]) -> list[str]:
        for item in value:  # the syntax `rollout_buffer.agents.egress.Mirrors` reads
            if not re.fullmatch(r"[A-Za-z0-9._-]+(:\d{1,5})?=(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}", item):
                raise ValueError(f"egress mirror {item!r}: give host=address:port or host:port=address:port")
        return value

    @field_validator("allow_url", "allowed_host", "cors_origin", "agent_sandbox", "egress_agent", "egress_verifier",
                     "egress_mirror", "egress_build", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        # URLs and factory paths contain ':', so the environment form separates them with commas or whitespace
        if isinstance(value, str):
            return [u for u in value.replace(",", " ").split() if u]
        return value

    @model_validator(mode="after")
    def _one_token_source(self) -> "Settings":
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("give auth_token or auth_token_file, not both")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("auth_token is empty")
        return self

    def resolved_auth_token(self) -> str | None:
        """The bearer token every route but /health requires, or None (no authentication). Reads
        `auth_token_file` (its first line, stripped) each call; raises ValueError for an empty file."""
        if self.auth_token is not None:
            return self.auth_token.get_secret_value().strip()
        if self.auth_token_file is None:
            return None
        try:
            text = self.auth_token_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"auth_token_file {str(self.auth_token_file)!r}: {exc.strerror}") from exc
        token = (text.splitlines() or [""])[0].strip()
        if not token:
            raise ValueError(f"auth_token_file {str(self.auth_token_file)!r} is empty")
        return token

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def gateway_body_bytes(self) -> int:
        """The body cap of the model routes (`/v1/...`): `max_gateway_body_mb`, capped by `max_body_mb`."""
        return min(int(self.max_gateway_body_mb * 1024 * 1024), self.max_body_bytes)
