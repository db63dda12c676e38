"""Published Terminal-Bench 2 tasks, unchanged but for `FROM`, scored by their own test.sh as Harbor scores them.

The tasks (`tests/fixtures/terminal_bench_2`, checked byte for byte against their published SHA-256) run their
test.sh as published: apt-get, uv's installer from astral.sh through curl, `uvx -p 3.13 ... pytest` from PyPI.
The verifier's egress is granted those hosts and `--egress-mirror` routes them to stand-ins on loopback (a test
CA's HTTPS for astral.sh, pypi.org and files.pythonhosted.org; an empty Debian archive), as an operator with
mirrors would run it. Through `tasks check --solutions` and through a real run with a scripted agent, a
solution scores 1 and an empty answer 0; with no egress granted, the same task is a warned start and a
counted `no_network`, never a silent 0."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.harbor_tasks import scripted_agent, start_harbor_run
from tests.support.helpers import REPO, ServerProcess, ServerSpec
from tests.support.runtime_helpers import drain, run_detail, wait_status
from tests.support.tb2_mirror import Mirror, base_image, check_solutions, published_hashes, rebase, running_mirror

pytestmark = pytest.mark.timeout(900)
FIXTURES = REPO / "tests" / "fixtures" / "terminal_bench_2"
TASKS = ("log-summary-date-ranges", "regex-log")
SERVER = ServerSpec(args=("--agent-sandbox", "docker"))  # grants no egress: the unmirrored operator


@pytest.fixture(scope="module")
def mirror() -> Iterator[Mirror]:
    with running_mirror() as running:
        yield running


@pytest.fixture(scope="module")
def dataset(docker_env: DockerEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The published tasks with their `FROM` naming the suite's trixie image (built once per Engine)."""
    image, root = base_image(docker_env.url), tmp_path_factory.mktemp("tb2")
    for task in TASKS:
        rebase(FIXTURES / task, root / task, image)
    return root


def grants(mirror: Mirror) -> list[str]:
    """The `--egress-*` options of an operator whose mirrors serve TB2's hosts."""
    return mirror.options()


def check(dataset: Path, env: DockerEnv, *extra: str) -> tuple[int, dict[str, Any]]:
    return check_solutions(dataset, env.url, *extra)


def test_the_fixtures_are_the_published_files_and_only_from_changes(tmp_path: Path) -> None:
    for task in json.loads((FIXTURES / "PUBLISHED.json").read_text()):  # every task kept here
        for name, digest in published_hashes(FIXTURES / task)["files"].items():
            assert hashlib.sha256((FIXTURES / task / name).read_bytes()).hexdigest() == digest, (task, name)
        copy = rebase(FIXTURES / task, tmp_path / task, "rollout-buffer-test-tb2:x")
        changed = [p.relative_to(copy) for p in copy.rglob("*") if p.is_file()
                   and p.read_bytes() != (FIXTURES / task / p.relative_to(copy)).read_bytes()]
        assert changed == [Path("environment/Dockerfile")]
        before, after = ((FIXTURES / task / "environment/Dockerfile").read_text().splitlines(),
                         (copy / "environment/Dockerfile").read_text().splitlines())
        assert [(a, b) for a, b in zip(before, after) if a != b] == [(next(x for x in before if x.startswith("FROM ")),
                                                                     "FROM rollout-buffer-test-tb2:x")]


def test_tasks_check_scores_each_solution_1_through_the_mirror_and_no_network_without_it(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv) -> None:  # noqa: F811
    code, report = check(dataset, docker_env, *grants(mirror))
    assert code == 0, report
    assert {row["task"]: (row["solution"], row["mode"]) for row in report["tasks"]} == \
        {task: ("reward 1", "clean") for task in TASKS}, report
    served = set(mirror.served)  # test.sh's own downloads, every one from a stand-in
    assert {"astral.sh/uv/0.9.5/install.sh", "pypi.org/simple/pytest/", "pypi.org/simple/pytest-json-ctrf/",
            "deb.debian.org/debian/dists/trixie/Release"} <= served, served
    assert "files.pythonhosted.org/packages/pytest-8.4.1-py3-none-any.whl" in served
    # no egress granted: a warning naming the verifier's network, and a no_network failure, never a silent 0
    code, report = check(dataset / "regex-log", docker_env)
    row = report["tasks"][0]
    assert code == 1 and row["solution"] == "failed", report
    assert any("verifier may reach the internet" in w["message"] for w in row["warnings"]), row
    problem = row["problems"][0]["message"]
    assert problem.startswith("error: no_network: ") and "astral.sh:443" in problem and "--egress-verifier" in problem


def _start(client: httpx.Client, dataset: Path, env: DockerEnv, engine_url: str, tokenizer: str) -> httpx.Response:
    agent = scripted_agent("solve")  # it also fetches pypi.org's page for pytest: the agent's own egress
    agent = {**agent, "env": {**agent["env"], "FETCH_URL": "https://pypi.org/simple/pytest/"},
             "sandbox": {"backend": "docker", "options": {"docker_host": env.url, "force_build": True}}}
    return start_harbor_run(client, dataset, agent, engine_url=engine_url, tokenizer_path=tokenizer, prefix="tb2",
                            num_process=4)


def test_a_run_scores_the_solved_task_1_and_the_unsolved_one_0_through_the_mirror(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv, rollout_engine: Any,  # noqa: F811
        qwen_tokenizer_path: str, tmp_path: Path) -> None:
    agent_grant = ("--egress-agent", "pypi.org")  # the agent phase's egress, mirrored as the verifier's
    with ServerProcess(tmp_path / "data", "--agent-sandbox", "docker", *grants(mirror), *agent_grant) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        answer = _start(client, dataset, docker_env, rollout_engine.url, qwen_tokenizer_path)
        assert answer.status_code == 200, answer.text
        assert not answer.json().get("warnings"), answer.json()  # both phases granted: nothing to warn about
        run_id = answer.json()["run_id"]
        detail = wait_status(client, run_id, "finished", timeout_s=600)
        records = {r["instance_id"]: r for r in drain(client, run_id, 2, timeout_s=60)}
    # the scripted agent writes regex-log's answer and nothing for log-summary-date-ranges: 1 and 0, as in Harbor
    assert records["regex-log"]["reward"] == 1.0, records["regex-log"]["extra_info"]
    for record in records.values():  # the agent reached pypi.org through its own egress, served by the mirror
        seen = json.loads(record["extra_info"]["agent"]["stdout_tail"].strip().splitlines()[-1])
        assert "pytest-8.4.1-py3-none-any.whl" in seen["fetched"], seen
    unsolved = records["log-summary-date-ranges"]
    assert unsolved["reward"] == 0.0 and unsolved["status"] in ("completed", "truncated"), unsolved["extra_info"]
    verifier = unsolved["extra_info"]["verifier"]
    assert "network_refused" not in verifier and "2 failed" in verifier["test_stdout_tail"], verifier
    assert "no_network" not in (detail.get("failures") or {}).get("by_type", {}), detail


def test_with_no_egress_granted_the_task_is_a_warned_start_and_a_counted_no_network(
        server: ServerProcess, client: httpx.Client, dataset: Path, docker_env: DockerEnv,  # noqa: F811
        rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    answer = _start(client, dataset / "regex-log", docker_env, rollout_engine.url, qwen_tokenizer_path)
    assert answer.status_code == 200, answer.text
    assert any(w.startswith("task 'regex-log': network: the task's verifier may reach the internet in Harbor")
               for w in answer.json()["warnings"]), answer.json()
    run_id = answer.json()["run_id"]
    detail = wait_status(client, run_id, "finished", timeout_s=600)
    failures = run_detail(client, run_id)["failures"]["by_type"]
    assert failures["no_network"]["count"] == 1, detail  # the solved task: its test.sh could not install pytest
    assert "astral.sh:443" in failures["no_network"]["example"], failures
