"""The local sandbox backend: a fresh folder per rollout and a guarded process group per command.

It isolates nothing (`serve --agent-sandbox local` says so at start): the agent runs as the server's user,
sees the host's processes and files and network, and can kill its own guard; then `ExecResult.extra` says
`guard_lost` and `killed` is False, never a claim that its tree was killed. For trusted agents on a
developer's machine; `bwrap` and `docker` are the backends for a policy under training.

Safe by default: each command runs under `guard.py` (its own session and process group, resource limits,
a subreaper that kills every descendant at the deadline, on cancel and when the worker dies), with an
environment built from scratch (PATH, HOME and TMPDIR inside the sandbox, LANG, then exactly what the run
names: nothing of the server's own environment, so no secret leaks into an agent). Output is read
concurrently and only its last `limits.output_bytes` are kept. Options: `root` (parent folder of the
sandboxes; default the system temp folder), `keep` (leave the folder after cleanup, for debugging).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_buffer.agents.sandbox import ExecResult, Limits, SandboxError

GUARD = Path(__file__).with_name("guard.py")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
KILL_GRACE_S = 5.0


class _Tail:
    """The last `limit` bytes of a stream, and how many bytes it carried in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[:len(self.data) - self.limit]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class LocalSandbox:
    """One rollout's sandbox on this host (see the module docstring)."""

    def __init__(self, *, name: str, limits: Limits, options: dict[str, Any] | None = None) -> None:
        options = dict(options or {})
        root = Path(options.get("root") or Path(tempfile.gettempdir()) / "rollout-buffer-sandboxes")
        try:
            root.mkdir(parents=True, exist_ok=True)
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
            self.root = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=root))
            for sub in ("work", "home", "tmp", ".guard"):
                (self.root / sub).mkdir(mode=0o700)
        except OSError as exc:
            raise SandboxError(f"cannot create a sandbox folder under {root}: {exc}") from exc
        self.limits = limits
        self.keep = bool(options.get("keep"))
        self.work = self.root / "work"
        self.home = self.root / "home"
        self._running: set[asyncio.subprocess.Process] = set()
        self._count = 0

    def _path(self, path: str) -> Path:
        base, rest = (self.home, path[2:]) if path.startswith("~/") else (self.work, path)
        target = (base / rest).resolve()
        if not target.is_relative_to(self.root.resolve()):
            raise SandboxError(f"path {path!r} leaves the sandbox")
        return target

    def base_env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, "HOME": str(self.home), "TMPDIR": str(self.root / "tmp"),
                "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PWD": str(self.work)}

    async def write_file(self, path: str, data: str | bytes) -> None:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    async def read_file(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    async def exec(self, argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                   cwd: str | None = None) -> ExecResult:
        self._count += 1
        status_path = self.root / ".guard" / f"status-{self._count}.json"
        limits = {"cpu_s": self.limits.cpu_s, "memory_bytes": self.limits.memory_bytes,
                  "open_files": self.limits.open_files, "file_size_bytes": self.limits.file_size_bytes}
        spec = {"argv": list(argv), "timeout_s": timeout_s, "status_path": str(status_path),
                "parent_pid": os.getpid(), "limits": limits}
        full_env = {**self.base_env(), **(env or {})}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(GUARD), json.dumps(spec), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=full_env,
                cwd=str(self._path(cwd) if cwd else self.work), start_new_session=True)
        except OSError as exc:
            raise SandboxError(f"cannot start a command in the sandbox: {exc}") from exc
        self._running.add(proc)
        out, err = _Tail(self.limits.output_bytes), _Tail(self.limits.output_bytes)
        try:
            readers = asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err))
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s + KILL_GRACE_S)
            except TimeoutError:
                _killpg(proc.pid, signal.SIGKILL)  # the guard itself hung: take the whole group down
                await proc.wait()
            try:  # an escaped process (the guard was killed) may hold the pipes open: stop reading them
                await asyncio.wait_for(readers, KILL_GRACE_S)
            except TimeoutError:
                readers.cancel()
                transport = getattr(proc, "_transport", None)  # close our ends of the pipes it holds
                if transport is not None:
                    transport.close()
        except BaseException:
            await self._stop(proc)
            raise
        finally:
            self._running.discard(proc)
        status = _read_status(status_path)
        timed_out = bool(status.get("timed_out")) if status else True
        code = int(status["exit_code"]) if status else (proc.returncode or 137)
        extra = {k: v for k, v in (status or {}).items() if k in ("signal", "stopped_by", "error")}
        # the guard kills the tree before it writes its status; with no status, the guard itself was killed
        # (the agent runs as this user and can do that) and nothing shows its tree is gone
        if status is None:
            extra.update(guard_lost=True, killed=False)
        elif timed_out or status.get("stopped_by"):
            extra["killed"] = True
        return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text(), timed_out=timed_out,
                          duration_s=round(time.monotonic() - started, 3), output_bytes=out.total + err.total,
                          truncated=out.total > len(out.data) or err.total > len(err.data), extra=extra)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """Ask the guard to kill everything (SIGTERM), then kill the whole group if it does not exit."""
        if proc.returncode is None:
            _killpg(proc.pid, signal.SIGTERM, only_leader=True)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
            except TimeoutError:
                pass
        _killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, TimeoutError):
            await asyncio.wait_for(proc.wait(), 2.0)

    async def cleanup(self) -> None:
        for proc in list(self._running):
            await self._stop(proc)
        self._running.clear()
        if not self.keep:
            await asyncio.to_thread(shutil.rmtree, self.root, True)


async def _pump(stream: asyncio.StreamReader | None, tail: _Tail) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        tail.add(chunk)


def _killpg(pgid: int, sig: int, *, only_leader: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if only_leader:
            os.kill(pgid, sig)
        else:
            os.killpg(pgid, sig)


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
