"""One `serve` per data dir: the first takes an exclusive lock on `<data_dir>/serve.lock` and writes its pid
there; a second one started on the same dir refuses to start and names that process.

Why: a second server on the same dir would otherwise join the first one's embedded Redis and share its runs
without a word (two buffers, one set of runs, two sets of workers). The kernel drops the lock when its holder
exits, however it exits, so a crash never leaves the dir locked."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = "serve.lock"


class DataDirInUse(RuntimeError):
    """Another live process holds the data dir."""


def _describe(pid: int | None) -> str:
    if pid is None:
        return "another process"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"process {pid} ({command[:200]})" if command else f"process {pid}"


def _holder(path: Path) -> int | None:
    """The pid the holder wrote (it writes just after locking: wait a moment for it)."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def lock_data_dir(data_dir: Path) -> int:
    """Take the data dir for this process; returns the lock's file descriptor (keep it open while serving).
    Raises DataDirInUse naming the process that holds it."""
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirInUse(f"the data dir {data_dir} is in use by {_describe(_holder(path))}: stop it, or give "
                           "this one another --data-dir (or ROLLOUT_BUFFER_DATA_DIR)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
