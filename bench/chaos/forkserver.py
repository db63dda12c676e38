"""A fork server for the processes the chaos run kills: the API, the worker and the trainer.

A Python process that imports FastAPI, the store, the runtime and `slime_adapter` takes 1-2 s of CPU on a
busy 2-core machine before it serves anything; at one kill of each kind every few seconds, fresh
interpreters would spend the run importing. So one parent (`python -m bench.chaos.forkserver`) imports
those modules once and forks a child per life. Each child still starts from nothing but its imports: the
API child opens its sockets, starts (or connects to) Redis and builds its app; the worker child joins the
job stream; the trainer child loads its checkpoint. The SIGKILL a fault sends hits that real serving
process, not the parent.

Protocol: one JSON line on stdin per child (`target`: "cli" runs `rollout_buffer.cli.main(argv)`,
"trainer" runs `bench.chaos.trainer`; `argv`, `env`, `log`), answered by one JSON line `{"pid": N}`.
The parent reaps its children itself (SIGCHLD ignored); EOF on stdin ends it and SIGKILLs what it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]


def _preload() -> None:
    """Import what the children run, so a fork starts with it."""
    import rollout_buffer.api.app  # noqa: F401
    import rollout_buffer.cli  # noqa: F401
    import rollout_buffer.runtime.worker_main  # noqa: F401
    import slime_adapter.hooks.agent_rollout  # noqa: F401
    import bench.chaos.trainer  # noqa: F401


def _child(spec: dict[str, Any]) -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the child waits on its own children (redis-server)
    os.setsid()  # a signal to the parent's group never reaches it
    os.environ.update(spec.get("env") or {})
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    argv = list(spec["argv"])
    if spec["target"] == "trainer":
        from bench.chaos.trainer import train

        train(Path(argv[0]), json.loads(Path(argv[1]).read_text()))
        return 0
    from rollout_buffer.cli import main

    return int(main(argv) or 0)


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    started: list[int] = []
    for line in stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(spec)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        started.append(pid)
        stdout.write(json.dumps({"pid": pid}) + "\n")
        stdout.flush()
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class ForkServer:
    """The harness's side: start the parent, ask it for children, stop it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()

    def __enter__(self) -> "ForkServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.forkserver"], cwd=REPO, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        return self

    def spawn(self, target: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        """A new child running `target` with `argv`; its pid."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps({"target": target, "argv": argv, "log": str(log),
                                              "env": env or {}}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server exited: {self.log.read_text(errors='replace')[-2000:]}")
        return int(json.loads(answer)["pid"])

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    """Whether a child of the fork server exists. Its parent ignores SIGCHLD, so the kernel reaps it once
    every thread has exited and every file (its locks, its sockets) is closed; a zombie leader whose other
    threads still exit counts as alive, since it may still hold them."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    _preload()
    serve(sys.stdin, sys.stdout)
