"""The process guard: the leader of an agent's process group, which it never lets outlive it.

Run by the local sandbox as `python -I guard.py SPEC_JSON` in a new session (so the guard leads its own
process group). It applies the resource limits to the agent it starts, becomes a child subreaper (an agent's
daemonised grandchildren re-parent to it instead of escaping to init), and kills every descendant, its
group and any process that left the group, when the agent exits, at the deadline, on SIGTERM (the
sandbox's cancel) and when its parent dies (`PR_SET_PDEATHSIG`, so a SIGKILLed worker orphans nothing).
Standard library only, and started with `-I`: it must not depend on the server's environment.

SPEC_JSON: {"argv": [...], "timeout_s": float, "status_path": str, "parent_pid": int,
            "limits": {"cpu_s", "memory_bytes", "open_files", "file_size_bytes"}} (limits optional).
The guard writes {"exit_code", "timed_out", "signal"} to status_path and exits with the agent's code.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_LIMITS = {"cpu_s": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_DATA,
           "open_files": resource.RLIMIT_NOFILE, "file_size_bytes": resource.RLIMIT_FSIZE}
_stop: list[str] = []


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, value, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """Every live descendant of `root`, read from /proc (children before their own children)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        parents.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all() -> None:
    """SIGKILL the group and every descendant until none is left (reaping them as their subreaper)."""
    me = os.getpid()
    for _ in range(50):
        try:
            os.killpg(os.getpgid(0), signal.SIGCONT)  # wake stopped ones so the kill lands
        except OSError:
            pass
        left = descendants(me)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        if not left:
            return
        time.sleep(0.02)


def _reap(agent_pid: int = -1) -> int | None:
    """Reap every exited child (orphans re-parent to the guard); the agent's exit code when it was one of
    them (negative: killed by that signal)."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == agent_pid:
            found = os.waitstatus_to_exitcode(status)


def _limits(spec: dict[str, int | None]) -> None:
    for name, value in spec.items():
        if value is not None and name in _LIMITS:
            hard = int(value) + 2 if name == "cpu_s" else int(value)  # SIGXCPU at the soft limit, SIGKILL 2 s on
            resource.setrlimit(_LIMITS[name], (int(value), hard))


def main() -> int:
    spec = json.loads(sys.argv[1])
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != spec["parent_pid"]:  # the parent died before the line above took effect
        return 125
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: _stop.append(signal.Signals(s).name))
    limits = spec.get("limits") or {}
    try:
        agent = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, preexec_fn=lambda: _limits(limits))
    except OSError as exc:
        print(f"cannot start the agent: {exc}", file=sys.stderr)
        _write(spec, {"exit_code": 127, "timed_out": False, "signal": None, "error": str(exc)})
        return 127
    deadline = time.monotonic() + float(spec["timeout_s"])
    code: int | None = None
    while code is None and not _stop and time.monotonic() < deadline:
        code = _reap(agent.pid)
        if code is None:
            time.sleep(0.05)
    timed_out = code is None and not _stop
    kill_all()
    if code is None:
        code = _reap(agent.pid)
    code = -signal.SIGKILL if code is None else code
    status = {"exit_code": code if code >= 0 else 128 - code, "timed_out": timed_out,
              "signal": -code if code < 0 else None, "stopped_by": _stop[0] if _stop else None}
    _write(spec, status)
    return int(status["exit_code"])


def _write(spec: dict, status: dict) -> None:
    with open(spec["status_path"], "w") as fh:
        json.dump(status, fh)


if __name__ == "__main__":
    sys.exit(main())
