"""What the chaos run runs and breaks: the test engine, the buffer server (API, its worker process, its
embedded `redis-server`, or a Redis Cluster with replicas), the proxy in front of it, and the injectors
that break each of them (`injectors()`: fault kind -> callable returning whether the fault landed).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from bench.chaos.proxy import CUT, DELAY, DROP, ChaosProxy, ProxyServer
from rollout_buffer.store import keys
from rollout_buffer.testing.engine import run_engine_in_thread
from tests.support.helpers import ServerProcess
from tests.support.process_tools import wait_for, worker_children
from tests.support.redis_cluster import LocalRedisCluster

TASKS = str(Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tasks")
ROLLOUT_TIMEOUT_S = 8.0  # a hung engine request ends the rollout (a failed record) after this long
TASK_LEASE_S = 6.0  # a killed worker's jobs are taken over by another after this long (claims renewed every 2 s)
SESSION_TIMEOUT_S = 20.0  # a gateway session whose agent lost it (its answer cut by a kill) is closed as failed


@dataclass
class Services:
    base: Path
    cluster: LocalRedisCluster | None = None
    wait_replicas: int = 0
    retain_runs: int | None = None
    engine: Any = None
    server: ServerProcess | None = None
    proxy: ChaosProxy | None = None
    proxy_url: str = ""
    memory: list[tuple[float, int, int]] = field(default_factory=list)  # (t, API RSS, Redis used_memory)
    restarts: dict[str, int] = field(default_factory=dict)

    def server_flags(self) -> list[str]:
        flags = ["--task-dir", TASKS, "--worker-processes", "1", "--rollout-timeout-s", str(ROLLOUT_TIMEOUT_S),
                 "--task-lease-s", str(TASK_LEASE_S), "--session-timeout-s", str(SESSION_TIMEOUT_S)]
        if self.cluster is not None:
            flags += ["--redis-url", self.cluster.url, "--redis-cluster"]
        if self.wait_replicas:
            flags += ["--redis-wait-replicas", str(self.wait_replicas)]
        if self.retain_runs is not None:
            flags += ["--retain-runs", str(self.retain_runs)]
        return flags

    @contextlib.contextmanager
    def running(self) -> Iterator["Services"]:
        with contextlib.ExitStack() as stack:
            self.engine = stack.enter_context(run_engine_in_thread(template="qwen2.5", seed=11, latency_s=0.05))
            self.server = stack.enter_context(ServerProcess(self.base / "data", *self.server_flags(),
                                                            env={"ROLLOUT_BUFFER_WORKER_PROCESSES": "1"}))
            self.proxy = ChaosProxy(self.server.url)
            self.proxy_url = stack.enter_context(ProxyServer(self.proxy)).url
            yield self

    # ----- health and memory ------------------------------------------------------------------

    def healthy(self, timeout_s: float = 60.0) -> None:
        assert self.server is not None

        def ok() -> bool:
            try:
                return httpx.get(f"{self.server.url}/health", timeout=2).status_code == 200  # type: ignore[union-attr]
            except httpx.HTTPError:
                return False

        wait_for(ok, timeout_s, "the buffer healthy again")

    def redis_memory(self) -> int:
        if self.cluster is not None:
            used = 0
            for index in self.cluster.primaries():
                with self.cluster.client(index) as client:
                    used += int(client.info("memory")["used_memory"])
            return used
        assert self.server is not None
        with redis.Redis(unix_socket_path=str(self.server.data_dir / "redis.sock"), socket_timeout=2) as client:
            return int(client.info("memory")["used_memory"])

    def sample_memory(self, t: float) -> None:
        assert self.server is not None and self.server.proc is not None
        try:
            rss = psutil.Process(self.server.proc.pid).memory_info().rss
            self.memory.append((t, rss, self.redis_memory()))
        except (psutil.Error, redis.RedisError, OSError, IndexError):
            pass  # mid-restart: the next sample counts

    # ----- faults -----------------------------------------------------------------------------

    def _restarted(self, what: str) -> None:
        self.restarts[what] = self.restarts.get(what, 0) + 1

    def kill_api(self) -> bool:
        assert self.server is not None
        self.server.kill(signal.SIGKILL)
        self.server.start(timeout_s=60)
        self._restarted("api")
        return True

    def kill_worker(self) -> bool:
        assert self.server is not None and self.server.proc is not None
        workers = worker_children(self.server.proc.pid)
        if not workers:
            return False  # being restarted by the supervisor
        os.kill(workers[0], signal.SIGKILL)
        return True

    def kill_redis(self) -> bool:
        assert self.server is not None
        pid_file = self.server.data_dir / "redis.pid"
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            return False
        self.healthy()  # the API restarts it from its append-only file
        return True

    def kill_primary(self, run_id: Callable[[], str | None]) -> bool:
        """SIGKILL the primary serving the current run's slot; wait for its replica's promotion, then start
        the killed node again (it rejoins as a replica)."""
        assert self.cluster is not None
        current = run_id()
        victim = self.cluster.primary_of_key(keys.run_meta(current)) if current else self.cluster.primaries()[0]
        self.cluster.kill(victim)
        self.cluster.wait_failover(victim)
        self.cluster.restart(victim)
        return True

    def engine_fault(self, knob: str) -> bool:
        self.engine.configure(**{knob: 1})
        return True

    def policy_bump(self, version: Callable[[], int]) -> bool:
        assert self.server is not None
        try:
            answer = httpx.post(f"{self.server.url}/policy_version", timeout=10,
                                json={"version": version(), "abort_in_flight": True})
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and bool(answer.json()["data"]["aborted"])

    def injectors(self, trainer_kill: Callable[[], bool], run_id: Callable[[], str | None],
                  version: Callable[[], int]) -> dict[str, Callable[[], bool]]:
        assert self.proxy is not None
        proxy = self.proxy
        kinds: dict[str, Callable[[], bool]] = {
            "api_kill": self.kill_api,
            "worker_kill": self.kill_worker,
            "trainer_kill": trainer_kill,
            DROP: lambda: proxy.arm(DROP) or True,
            CUT: lambda: proxy.arm(CUT) or True,
            DELAY: lambda: proxy.arm(DELAY) or True,
            "engine_error": lambda: self.engine_fault("fail_next"),
            "engine_timeout": lambda: self.engine_fault("hang_next"),
            "engine_abort": lambda: self.engine_fault("abort_next"),
            "policy_bump": lambda: self.policy_bump(version),
        }
        if self.cluster is None:
            kinds["redis_kill"] = self.kill_redis
        else:
            kinds["primary_kill"] = lambda: self.kill_primary(run_id)
        return kinds

