"""`rollout-buffer tasks check DIR`: every task parsed, images found or built, reference solutions run through
the task's own verifier; a table with one row per task, and a failing exit status when any task is broken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.harbor_tasks import add_broken_build, make_dataset

pytestmark = pytest.mark.timeout(600)


def _check(*args: str, env_url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    if env_url:
        env["DOCKER_HOST"] = env_url
    return subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", *args], env=env,
                          capture_output=True, text=True, timeout=500)


def _rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line and not line[0].isdigit()}


def test_reference_solutions_score_one_and_broken_tasks_are_named(tmp_path: Path,
                                                                   docker_env: DockerEnv) -> None:  # noqa: F811
    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    clean = _check(str(dataset), env_url=None)  # parse only: no Engine needed
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "4/4 tasks ok" in clean.stdout
    add_broken_build(dataset)
    toml = dataset / "hello" / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 60.0", "timeout_sec = -1"))
    done = _check(str(dataset), "--solutions", "--docker-host", docker_env.url, env_url=None)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["TASK"].split() == ["TASK", "PARSE", "IMAGE", "SOLUTION", "OK"]
    assert "reward 1" in rows["fix-bug"] and "rollout-buffer-harbor/fix-bug:" in rows["fix-bug"]
    assert rows["fix-bug"].endswith("yes") and rows["partial"].endswith("yes") and "reward 1" in rows["partial"]
    assert "task.toml [verifier] timeout_sec" in rows["hello"] and rows["hello"].endswith("NO")
    assert "build failed" in rows["broken-build"] and rows["broken-build"].endswith("NO")
    assert "wrote no reward" in rows["no-reward"] and rows["no-reward"].endswith("NO")
    assert "2/5 tasks ok" in done.stdout
