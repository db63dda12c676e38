"""A published Terminal-Bench 2 task whose Dockerfile installs at build time, unchanged but for `FROM`.

`constraints-scheduling` (`tests/fixtures/terminal_bench_2`, checked against its published SHA-256 by
`test_harbor_tb2.py`) builds with `apt-get update && apt-get install -y --no-install-recommends python3
python3-pip`. The operator grants builds the Debian archive (`--egress-build deb.debian.org`), routed by
`--egress-mirror` to the stand-in archive on loopback, which serves Debian trixie's own python3-pip .debs
(fetched from Debian's archive at set-up, `tb2_mirror.debs`). Without the grant the build has no network and
fails as an infrastructure failure saying so; with it the image holds pip, and through `tasks check
--solutions` the solution scores 1 and no answer 0, by the task's own test.sh."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_buffer.agents.harbor.images import image_tag
from rollout_buffer.tasks.harbor import read_task
from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.helpers import REPO
from tests.support.registry import remove_image
from tests.support.tb2_mirror import Mirror, base_image, check_solutions, rebase, running_mirror

pytestmark = pytest.mark.timeout(900)
TASK = "constraints-scheduling"
FIXTURE = REPO / "tests" / "fixtures" / "terminal_bench_2" / TASK
PACKAGES = ("python3-pip", "python3-wheel", "python3-packaging")  # what it installs, and what pip needs beside


@pytest.fixture(scope="module")
def mirror() -> Iterator[Mirror]:
    with running_mirror(PACKAGES) as running:
        yield running


@pytest.fixture(scope="module")
def dataset(docker_env: DockerEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # noqa: F811
    """The task with its `FROM` naming the suite's trixie image; its built image is absent before and after."""
    root = tmp_path_factory.mktemp("tb2-build")
    rebase(FIXTURE, root / TASK, base_image(docker_env.url))
    tag = image_tag(read_task(root / TASK)["harbor"])
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


def test_no_answer_scores_0(dataset: Path, mirror: Mirror, docker_env: DockerEnv, tmp_path: Path) -> None:  # noqa: F811
    unsolved = tmp_path / TASK  # the same task (its image found built) with a solution that answers nothing
    shutil.copytree(dataset / TASK, unsolved)
    (unsolved / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    code, report = check_solutions(unsolved, docker_env.url, *mirror.options(build=True))
    row = report["tasks"][0]
    assert code == 1 and row["solution"] == "reward 0", report
    assert row["problems"] == [{"field": "solution", "message": "the reference solution scored 0, not 1"}], report
