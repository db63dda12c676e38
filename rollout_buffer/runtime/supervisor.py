"""Worker processes that live and die with the command that started them.

`serve --worker-processes N` and `rollout-buffer worker --processes N` run N rollout worker processes
(`python -m rollout_buffer.runtime.supervisor`, see `child_main`), which join the job stream's consumer group like any
other worker. Their life follows the parent's:

* started with it, each told its place (`index` of `count`) so the processes split every run's
  `num_process` between them instead of each taking all of it;
* restarted when one dies, after a backoff that doubles (1 s up to 30 s) while it keeps dying young;
* stopped with it: SIGTERM (a worker lets its rollouts finish for a few seconds and releases the rest to
  other workers), then SIGKILL for any still running after the grace period;
* never orphaned: the child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG, as the
  embedded Redis does), even a SIGKILLed parent, and runs in a session of its own, so a terminal's Ctrl+C
  reaches only the parent, which then stops the children before it stops Redis.

Children are spawned from the event loop's thread, never from a worker thread: the kernel ties the
parent-death signal to the thread that forked, and a pool thread may exit long before the process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.runtime.worker_env import require_redis_url, stop_event
from rollout_buffer.settings import Settings

log = logging.getLogger(__name__)

SPEC_ENV = "ROLLOUT_BUFFER_WORKER_CHILD"  # the child's settings and place, as JSON (not a settings field)
STOP_GRACE_S = 15.0  # the worker's own shutdown (5 s for in-flight rollouts, then releasing them) fits in this
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """What a worker process is told by its parent: its settings, its place, and who its parent is."""

    settings: dict[str, Any]
    index: int
    count: int
    parent_pid: int

    def to_env(self) -> str:
        return json.dumps({"settings": self.settings, "index": self.index, "count": self.count,
                           "parent_pid": self.parent_pid})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, name: str = SPEC_ENV) -> ChildSpec | None:
        raw = (environ if environ is not None else os.environ).get(name)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(settings=data["settings"], index=int(data["index"]), count=int(data["count"]),
                   parent_pid=int(data["parent_pid"]))


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a child: SIGTERM this process when its parent dies; exit now if it already has
    (a parent killed between fork and this call would otherwise leave the child orphaned)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's stop() is then the only way children end
        log.warning("PR_SET_PDEATHSIG is unavailable: worker processes may outlive a killed parent")
    if os.getppid() != parent_pid:
        os._exit(0)


def child_settings(settings: Settings, redis_url: str | None) -> dict[str, Any]:
    """The parent's settings as a child runs them: one process (itself), on the parent's Redis."""
    data = settings.model_dump(mode="json")
    data.update(worker_processes=1, redis_url=redis_url or settings.redis_url)
    if settings.auth_token is not None:  # JSON masks a secret: hand the child the token itself
        data["auth_token"] = settings.auth_token.get_secret_value()
    return data


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each soon after its start: the backoff doubles with them
    restart_at: float = 0.0


@dataclass
class WorkerSupervisor:
    """Starts, watches, restarts and stops `count` worker processes (see the module docstring). The API
    processes of `serve --api-processes N` are supervised the same way (`module`, `spec_env`, `overrides`:
    what they run and are told; `pass_fds`: the listening socket they share)."""

    settings: Settings
    count: int
    redis_url: str | None = None
    module: str = "rollout_buffer.runtime.supervisor"
    spec_env: str = SPEC_ENV
    what: str = "worker"
    overrides: dict[str, Any] = field(default_factory=dict)  # settings the children run with instead
    pass_fds: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # more environment for the children
    grace_s: float = STOP_GRACE_S
    poll_s: float = 0.2
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0  # a child alive this long has its backoff reset
    restarts: int = 0
    _children: list[_Child] = field(default_factory=list)
    _monitor: asyncio.Task[None] | None = None
    _stopping: bool = False

    @property
    def pids(self) -> list[int]:
        """The pids of the children running now."""
        return [c.proc.pid for c in self._children if c.proc is not None and c.proc.poll() is None]

    def failing(self, deaths: int) -> bool:
        """Whether every child has died young `deaths` times in a row (it cannot start: give up)."""
        return bool(self._children) and all(c.quick_deaths >= deaths for c in self._children)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module]

    def start(self) -> None:
        """Spawn every child and start watching them (on the running event loop, from its thread)."""
        if self._children:
            return
        loop = asyncio.get_running_loop()  # raises RuntimeError, spawning nothing, when called without one
        self._children = [_Child(index=i) for i in range(self.count)]
        for child in self._children:
            self._spawn(child)
        self._monitor = loop.create_task(self._watch(), name="worker-supervisor")
        log.info("started %d %s process(es): pids %s", self.count, self.what, self.pids)

    def _spawn(self, child: _Child) -> None:
        spec = ChildSpec(settings={**child_settings(self.settings, self.redis_url), **self.overrides},
                         index=child.index, count=self.count, parent_pid=os.getpid())
        try:
            child.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, start_new_session=True,
                                          env={**os.environ, **self.env, self.spec_env: spec.to_env()},
                                          pass_fds=self.pass_fds)
        except OSError as exc:
            child.proc = None
            child.quick_deaths += 1
            child.restart_at = time.monotonic() + self._backoff(child)
            log.error("could not start %s process %d: %s", self.what, child.index, exc)
            return
        child.started_at = time.monotonic()

    def _backoff(self, child: _Child) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, child.quick_deaths - 1))

    async def _watch(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            for child in self._children:
                if child.proc is None:
                    if now >= child.restart_at:
                        self._spawn(child)
                        if child.proc is not None:
                            log.warning("%s process %d restarted: pid %d", self.what, child.index,
                                        child.proc.pid)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                young = now - child.started_at < self.healthy_after_s
                child.quick_deaths = child.quick_deaths + 1 if young else 1
                delay = self._backoff(child)
                child.proc, child.restart_at = None, now + delay
                self.restarts += 1
                log.error("%s process %d exited with %s; restarting it in %.2fs", self.what, child.index, code,
                          delay)
            await asyncio.sleep(self.poll_s)

    async def stop(self) -> None:
        """SIGTERM every child, wait up to `grace_s` for them to finish, SIGKILL what is left."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        procs = [c.proc for c in self._children if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                log.warning("%s process pid %d did not stop within %.0fs; killing it", self.what, proc.pid,
                            self.grace_s)
                proc.kill()
                proc.wait()
        log.info("%s processes stopped (%d restart(s) while running)", self.what, self.restarts)


def run_supervised_workers(settings: Settings) -> int:
    """`rollout-buffer worker --processes N` (N > 1): supervise N worker processes until SIGINT/SIGTERM.
    This parent only watches; it imports none of the rollout machinery."""
    url = require_redis_url(settings)

    async def main() -> None:
        stop = stop_event()
        supervisor = WorkerSupervisor(settings, settings.worker_processes, redis_url=url)
        supervisor.start()
        try:
            await stop.wait()
        finally:
            await supervisor.stop()

    asyncio.run(main())
    return 0


def child_main() -> int:
    """Entry point of a supervised worker process: the parent-death signal first, before the seconds of
    imports, then the worker (`rollout_buffer.runtime.worker_main.run_worker`) with its share."""
    spec = ChildSpec.from_env()
    if spec is None:
        print("this module is started by `rollout-buffer serve` or `rollout-buffer worker --processes N`",
              file=sys.stderr)
        return 2
    die_with_parent(spec.parent_pid)
    from rollout_buffer.logs import configure_logging, hide_torch_notice

    hide_torch_notice()  # before the worker imports transformers
    settings = Settings(**spec.settings)
    configure_logging(settings.log_level)
    from rollout_buffer.runtime.worker_main import run_worker

    return run_worker(settings, share=(spec.index, spec.count), hard_exit_after_s=STOP_GRACE_S + 5)


if __name__ == "__main__":
    sys.exit(child_main())
