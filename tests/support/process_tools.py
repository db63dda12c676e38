"""Finding and waiting on real processes from tests: children by parent pid (read from /proc), liveness
that treats zombies as dead, and the task stream's consumers (which worker process took tasks)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import redis

from rollout_buffer.store import keys

WORKER_MARK = "rollout_buffer.runtime.supervisor"  # a supervised worker process's command line


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int, mark: str = "") -> list[int]:
    """Live children of `pid` whose command line contains `mark`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        child = int(entry.name)
        try:
            if int(_stat(child)[1]) != pid or not alive(child):
                continue
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if mark in command:
            found.append(child)
    return sorted(found)


def worker_children(pid: int) -> list[int]:
    return children(pid, WORKER_MARK)


def wait_for(condition, timeout_s: float = 15.0, what: str = "condition",  # type: ignore[no-untyped-def]
             every_s: float = 0.05):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(every_s)


def all_gone(pids: list[int], timeout_s: float) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), timeout_s,
             f"processes still running: {[p for p in pids if alive(p)]}")


def consumer_pids(redis_url: str, run_id: str) -> set[int]:
    """The pids of the worker processes that took tasks of a run (consumer names are host:pid:nonce:loop)."""
    client = redis.Redis.from_url(redis_url)
    try:
        consumers = client.xinfo_consumers(keys.tasks(run_id), keys.WORKER_GROUP)
    finally:
        client.close()
    names = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in consumers]
    return {int(name.split(":")[1]) for name in names}


def sigint_default() -> None:
    """`preexec_fn` for a child a test will stop with SIGINT (Ctrl+C): a shell's background job (`pytest &`)
    ignores SIGINT, and an ignored signal stays ignored across exec, so without this the child never sees it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sigint_ignored() -> None:
    """`preexec_fn` for a child started as a shell's background job would be: SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
