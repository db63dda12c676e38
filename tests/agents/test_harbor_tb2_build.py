"""A published Terminal-Bench 2 task whose Dockerfile installs at build time, unchanged but for `FROM`.

`constraints-scheduling` (`tests/fixtures/terminal_bench_2`, checked against its published SHA-256 by
`test_harbor_tb2.py`) builds with `apt-get update && apt-get install -y --no-install-recommends python3
python3-pip`. The operator grants builds the Debian archive (`--egress-build deb.debian.org`), routed by
`--egress-mirror` to the stand-in archive on loopback, which serves Debian trixie's own python3-pip .debs
(fetched from Debian's archive at set-up, `tb2_mirror.debs`). Without the grant the build has no network and
fails as an infrastructure failure saying so; with it the image holds pip, and through `tasks check
--solutions` the solution scores 1 by the task's own test.sh. A run takes the grant the same way: without it the
rollout is a counted `sandbox_error` saying the build had no network, with it the image is built and test.sh
scores the agent's (empty) answer 0."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.agents.harbor.images import image_tag
from rollout_buffer.tasks.harbor import environment_hash, read_task
from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.harbor_tasks import scripted_agent, start_harbor_run
from tests.support.helpers import REPO, ServerProcess
from tests.support.runtime_helpers import drain, run_detail, wait_status
from tests.support.registry import remove_image
from tests.support.tb2_mirror import Mirror, base_image, check_solutions, rebase, running_mirror

pytestmark = pytest.mark.timeout(900)
TASK = "constraints-scheduling"
FIXTURE = REPO / "tests" / "fixtures" / "terminal_bench_2" / TASK
PACKAGES = ("python3-pip", "python3-wheel", "python3-packaging")  # what it installs, and what pip needs beside


def built_tag(task: Path) -> str:
    """The tag a build of the task folder gets (its content's hash)."""
    harbor = read_task(task)["harbor"]
    return image_tag(harbor, environment_hash(task / "environment", str(harbor["name"])))


@pytest.fixture(scope="module")
def mirror() -> Iterator[Mirror]:
    with running_mirror(PACKAGES) as running:
        yield running


@pytest.fixture(scope="module")
def dataset(docker_env: DockerEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # noqa: F811
    """The task with its `FROM` naming the suite's trixie image; its built image is absent before and after."""
    root = tmp_path_factory.mktemp("tb2-build")
    rebase(FIXTURE, root / TASK, base_image(docker_env.url))
    tag = built_tag(root / TASK)
    assert tag.startswith(f"rollout-buffer-harbor/{TASK}:") and not tag.endswith(":None")
    remove_image(docker_env.url, tag)
    yield root
    remove_image(docker_env.url, tag)


def test_without_a_build_grant_the_build_has_no_network_and_fails_saying_so(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv) -> None:  # noqa: F811
    code, report = check_solutions(dataset, docker_env.url, *mirror.options())
    row = report["tasks"][0]
    assert code == 1 and row["image"] == "failed" and row["solution"] == "-", report
    message = row["problems"][0]["message"]
    assert "build failed" in message and "python3-pip" in message, message
    assert "this build had no network: grant the hosts it downloads from with --egress-build" in message
    assert not any(path.startswith("deb.debian.org/debian/pool/") for path in mirror.served)


def test_with_the_archive_granted_the_image_holds_pip_and_the_solution_scores_1(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv) -> None:  # noqa: F811
    code, report = check_solutions(dataset, docker_env.url, *mirror.options(build=True))
    row = report["tasks"][0]
    assert code == 0 and (row["solution"], row["mode"]) == ("reward 1", "clean"), report
    assert any(p.startswith("deb.debian.org/debian/pool/main/python3-pip_") for p in mirror.served), mirror.served
    pip = subprocess.run(["docker", "-H", docker_env.url, "run", "--rm", "--network", "none", row["image"], "python3",
                          "-m", "pip", "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert pip.returncode == 0 and pip.stdout.startswith("pip 25."), pip.stderr


def _run(dataset: Path, env: DockerEnv, engine: Any, tokenizer: str, data: Path, *options: str) -> tuple[dict, list]:
    """A run of the task with the scripted agent (it answers nothing here): its detail and its records."""
    agent = {**scripted_agent("solve"),
             "sandbox": {"backend": "docker", "options": {"docker_host": env.url, "force_build": True}}}
    with ServerProcess(data, "--agent-sandbox", "docker", *options) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        answer = start_harbor_run(client, dataset, agent, engine_url=engine.url, tokenizer_path=tokenizer,
                                  prefix="tb2b")
        assert answer.status_code == 200, answer.text
        run_id = answer.json()["run_id"]
        wait_status(client, run_id, "finished", timeout_s=600)
        detail = run_detail(client, run_id)
        records = drain(client, run_id, 1, timeout_s=60) if not detail["failures"]["by_type"] else []
    return detail, records


def test_a_run_takes_the_build_grant(dataset: Path, mirror: Mirror, docker_env: DockerEnv,  # noqa: F811
                                     rollout_engine: Any, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    remove_image(docker_env.url, built_tag(dataset / TASK))  # built by the run, or not at all
    detail, _ = _run(dataset, docker_env, rollout_engine, qwen_tokenizer_path, tmp_path / "none", *mirror.options())
    failed = detail["failures"]["by_type"].get("sandbox_error") or {"count": 0, "example": ""}
    assert failed["count"] == 1 and "this build had no network" in failed["example"], detail["failures"]
    detail, records = _run(dataset, docker_env, rollout_engine, qwen_tokenizer_path, tmp_path / "granted",
                           *mirror.options(build=True))
    assert not detail["failures"]["by_type"], detail["failures"]
    assert [r["reward"] for r in records] == [0.0], records  # the image built; test.sh scored the empty answer
    assert "3 failed" in records[0]["extra_info"]["verifier"]["test_stdout_tail"], records[0]["extra_info"]
