"""A second `rollout-buffer serve` on a data dir already in use refuses to start, naming the process that
holds it (before, it joined the first one's embedded Redis and shared its runs without a word)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.helpers import REPO, ServerProcess, free_port


def serve_again(data_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "serve", "--port", str(free_port()),
                           "--data-dir", str(data_dir)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_second_serve_on_a_data_dir_in_use_refuses_naming_the_holder(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with ServerProcess(data_dir) as first:
        assert first.proc is not None
        second = serve_again(data_dir, first.env)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"the data dir {data_dir.resolve()} is in use by process {first.proc.pid} (" in second.stderr
        assert "rollout_buffer.cli serve" in second.stderr and "--data-dir" in second.stderr
        assert "Traceback" not in second.stderr
        assert httpx.get(f"{first.url}/health", timeout=30).status_code == 200, "the first one serves on"
    with ServerProcess(data_dir) as again:  # the lock goes with its holder: the dir is free once it stopped
        assert httpx.get(f"{again.url}/health", timeout=30).status_code == 200


def test_a_killed_server_leaves_the_data_dir_free(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = ServerProcess(data_dir).start()
    first.kill()  # SIGKILL: no clean-up ran, the kernel dropped the lock
    with ServerProcess(data_dir) as second:
        assert httpx.get(f"{second.url}/health", timeout=30).status_code == 200
