"""The local sandbox backend with real processes: a clean environment, resource limits, bounded output,
files kept inside, and no process left behind at the deadline, on cancel, or after a SIGKILL of the
process that ran it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_buffer.agents.local import LocalSandbox
from rollout_buffer.agents.sandbox import Limits, SandboxError, load_factory, open_sandbox
from tests.support.process_tools import alive, all_gone, wait_for

# A command that starts a tree: a background child, a grandchild that leaves the process group (setsid),
# and a daemon that double-forks away from its parent; it writes their pids, then waits forever.
TREE = textwrap.dedent("""
    sleep 300 & echo $! >> "$PIDS"
    setsid sleep 301 & echo $! >> "$PIDS"
    ( setsid bash -c 'echo $$ >> "$PIDS"; exec sleep 302' & ) 
    echo $$ >> "$PIDS"
    echo started
    sleep 303
""")


def _pids(path: Path, count: int) -> list[int]:
    wait_for(lambda: path.exists() and len(path.read_text().split()) >= count, 15.0, f"{count} pids in {path}")
    return [int(p) for p in path.read_text().split()]


async def _sandbox(tmp_path: Path, **limits: int | None) -> LocalSandbox:
    return await open_sandbox(None, name="t", limits=Limits(**limits), options={"root": str(tmp_path / "boxes")})


async def test_environment_is_built_from_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_SECRET_TOKEN", "do-not-leak")
    box = await _sandbox(tmp_path)
    try:
        run = await box.exec(["bash", "-c", "env; pwd"], timeout_s=10, env={"ANTHROPIC_API_KEY": "k1"})
    finally:
        await box.cleanup()
    lines = run.stdout.splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    assert run.ok and "SERVER_SECRET_TOKEN" not in env and env["ANTHROPIC_API_KEY"] == "k1"
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PWD", "SHLVL", "_", "ANTHROPIC_API_KEY"}
    assert env["HOME"].startswith(str(tmp_path)) and lines[-1] == str(box.work)
    assert not box.root.exists(), "cleanup removes the sandbox"


async def test_files_stay_inside(tmp_path: Path) -> None:
    box = await _sandbox(tmp_path)
    try:
        await box.write_file("src/a.txt", "hello")
        await box.write_file("~/.agent/config.json", "{}")
        assert await box.read_file("src/a.txt") == b"hello"
        assert (box.home / ".agent" / "config.json").read_text() == "{}"
        run = await box.exec(["cat", "src/a.txt"], timeout_s=10)
        assert run.stdout == "hello"
        for bad in ("../../escape.txt", "/etc/passwd", "~/../../x"):
            with pytest.raises(SandboxError, match="leaves the sandbox"):
                await box.write_file(bad, "x")
    finally:
        await box.cleanup()


async def test_deadline_kills_the_whole_tree(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    box = await _sandbox(tmp_path)
    try:
        run = await box.exec(["bash", "-c", TREE], timeout_s=2, env={"PIDS": str(pids_file)})
    finally:
        await box.cleanup()
    assert run.timed_out and not run.ok and run.exit_code == 137 and run.stdout == "started\n"
    assert 2 <= run.duration_s < 8
    pids = _pids(pids_file, 4)
    all_gone(pids, 5.0)


async def test_cancel_kills_the_whole_tree(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    box = await _sandbox(tmp_path)
    task = asyncio.create_task(box.exec(["bash", "-c", TREE], timeout_s=300, env={"PIDS": str(pids_file)}))
    pids = await asyncio.to_thread(_pids, pids_file, 4)
    assert all(alive(p) for p in pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await box.cleanup()
    all_gone(pids, 5.0)


def test_sigkill_of_the_worker_orphans_nothing(tmp_path: Path) -> None:
    """The process running the sandbox dies by SIGKILL (no cleanup code runs): the guard sees its parent die
    and kills the agent's whole tree."""
    pids_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import asyncio
        from rollout_buffer.agents.local import LocalSandbox
        from rollout_buffer.agents.sandbox import Limits
        box = LocalSandbox(name="killed", limits=Limits(), options={{"root": {str(tmp_path)!r}}})
        asyncio.run(box.exec(["bash", "-c", {TREE!r}], timeout_s=300, env={{"PIDS": {str(pids_file)!r}}}))
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], env={**os.environ})
    try:
        pids = _pids(pids_file, 4)
        assert all(alive(p) for p in pids)
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.wait(timeout=10) == -signal.SIGKILL
        all_gone(pids, 10.0)
    finally:
        if worker.poll() is None:
            worker.kill()


async def test_resource_limits_apply(tmp_path: Path) -> None:
    box = await _sandbox(tmp_path, cpu_s=1, open_files=64, memory_bytes=256 << 20, file_size_bytes=1 << 20)
    try:
        files = await box.exec(["bash", "-c", "ulimit -n; ulimit -f"], timeout_s=10)
        assert files.stdout.split() == ["64", str((1 << 20) // 1024)]
        spin = await box.exec([sys.executable, "-c", "while True: pass"], timeout_s=30)
        assert spin.exit_code == 128 + signal.SIGXCPU and not spin.timed_out and spin.duration_s < 15
        hog = await box.exec([sys.executable, "-c", "x = bytearray(512 << 20)"], timeout_s=30)
        assert hog.exit_code == 1 and "MemoryError" in hog.stderr
        big = await box.exec(["bash", "-c", "head -c 2000000 /dev/zero > big.bin"], timeout_s=30)
        assert big.exit_code != 0 and (box.work / "big.bin").stat().st_size == 1 << 20
    finally:
        await box.cleanup()


async def test_output_is_bounded_and_counted(tmp_path: Path) -> None:
    box = await open_sandbox(None, name="out", limits=Limits(output_bytes=1000), options={"root": str(tmp_path)})
    try:
        run = await box.exec(["bash", "-c", "seq 1 200000; echo END"], timeout_s=30)
    finally:
        await box.cleanup()
    assert run.ok and run.truncated and len(run.stdout) == 1000 and run.stdout.endswith("200000\nEND\n")
    assert run.output_bytes == len("\n".join(str(i) for i in range(1, 200001))) + len("\nEND\n")


async def test_backends_plug_in_by_module_path(tmp_path: Path) -> None:
    assert load_factory("rollout_buffer.agents.local:LocalSandbox") is LocalSandbox
    for bad, reason in (("nomodule", "package.module:factory"), ("no.such.module:X", "cannot import"),
                        ("rollout_buffer.agents.local:Nope", "not a callable")):
        with pytest.raises(ValueError, match=reason):
            load_factory(bad)
    with pytest.raises(SandboxError, match="cannot create a sandbox"):
        await open_sandbox(None, name="x", limits=Limits(), options={"root": "/proc/no-such-place"})
    made = await open_sandbox("rollout_buffer.agents.local:LocalSandbox", name="y", limits=Limits(),
                              options={"root": str(tmp_path)})
    assert isinstance(made, LocalSandbox)
    await made.cleanup()


def test_limits_read_from_run_options() -> None:
    limits = Limits.from_options({"cpu_s": 30, "memory_mb": 512, "open_files": 256, "file_size_mb": 10,
                                  "output_kb": 64})
    assert limits == Limits(cpu_s=30, memory_bytes=512 << 20, open_files=256, file_size_bytes=10 << 20,
                            output_bytes=64 << 10)
    assert Limits.from_options({"memory_mb": None}).memory_bytes is None and Limits.from_options(None) == Limits()
    for bad, reason in (({"memory_mb": 0}, "memory_mb"), ({"cpu_s": 1.5}, "cpu_s"), ({"disk_space": 1}, "unknown"), ({"pids": 0}, "pids"), ({"cpus": 0}, "cpus"),
                        ({"output_kb": None}, "output_kb")):
        with pytest.raises(ValueError, match=reason):
            Limits.from_options(bad)


async def test_an_agent_that_kills_its_guard_is_not_reported_killed(tmp_path: Path) -> None:
    """`local` isolates nothing: an agent may kill its own guard. Then the result never claims its tree was
    killed (`killed` False, `guard_lost`); a deadline that ends normally does claim it, and then it holds."""
    box = await _sandbox(tmp_path)
    escapee = "sleep 97.5"
    try:
        lost = await box.exec(["bash", "-c", f"setsid bash -c 'trap \"\" TERM; {escapee}' & sleep 0.3; kill -9 $PPID"],
                              timeout_s=5)
        assert lost.extra["guard_lost"] is True and lost.extra["killed"] is False
        timed = await box.exec(["bash", "-c", "sleep 60"], timeout_s=1)
        assert timed.timed_out and timed.extra["killed"] is True and "guard_lost" not in timed.extra
        normal = await box.exec(["true"], timeout_s=5)
        assert normal.ok and "killed" not in normal.extra
    finally:
        await box.cleanup()
        subprocess.run(["pkill", "-f", escapee], check=False)
