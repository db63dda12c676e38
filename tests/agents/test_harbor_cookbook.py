"""Harbor's own published examples, unchanged but for `FROM`: the harbor-cookbook recipes `simple-task`,
`multi-container` (a compose task whose `api-server` service the agent reaches by name), `multi-reward` (a
reward.json of two rewards) and `skills` (`skills_dir`), kept in `tests/fixtures/harbor_cookbook` and checked
byte for byte against `PUBLISHED.json` before anything runs; and `multi-step` (Harbor's `[[steps]]` layout),
kept to show that `tasks check` refuses it with every reason at once; and `dns-blacklisting`, kept to show that
the check reports its Dockerfile's ENTRYPOINT as not run here.

Their test.sh files run as published (apt-get, uv 0.9.7 from astral.sh, `uvx --with pytest ...` from PyPI), and
their Dockerfiles build as published (`apt-get install`, `pip install flask` in the service's): the verifier and
the builds are granted those hosts, routed by `--egress-mirror` to the TB2 stand-ins on loopback (which also
serve uv 0.9.7 and flask's wheels). Every `FROM` names the suite's trixie image; the service's, a stand-in for
`python:3.12-slim` (`tests/support/harbor_cookbook.py`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.agents.harbor.images import image_tag
from rollout_buffer.tasks.harbor import environment_hash, read_task
from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.harbor_cookbook import FIXTURES, changed_files, published, python_image, rebase_all
from tests.support.harbor_tasks import scripted_agent, start_harbor_run
from tests.support.helpers import REPO, ServerProcess
from tests.support.registry import remove_image
from tests.support.runtime_helpers import drain, wait_status
from tests.support.tb2_mirror import Mirror, base_image, check_solutions, running_mirror, wheels

pytestmark = pytest.mark.timeout(600)
RECIPES = ("multi-container", "multi-reward", "simple-task", "skills")
REFUSED = ("multi-step",)  # Harbor's [[steps]] layout: kept to show it is refused, whole, at parse
WARNED = ("dns-blacklisting",)  # its image's ENTRYPOINT sets the task up: kept to show that is reported
SERVICE = "environment/api-server/Dockerfile"  # multi-container's service, FROM python:3.12-slim
MORE_WHEELS = ("uv==0.9.7", "flask==3.1.3")  # the cookbook's uv, and what the service's Dockerfile pip-installs
WEIGHTS = {"correctness": 0.75, "performance": 0.25}


@pytest.fixture(scope="module")
def mirror() -> Iterator[Mirror]:
    with running_mirror(more=wheels(MORE_WHEELS, "wheels-cookbook")) as running:
        yield running


def grants(mirror: Mirror) -> list[str]:
    """The TB2 operator's grants and mirrors, and builds granted PyPI (the service's `pip install flask`)."""
    return [*mirror.options(build=True), "--egress-build", "pypi.org", "--egress-build", "files.pythonhosted.org"]


def built_tags(root: Path) -> list[str]:
    """The tags the recipes' builds get (their content's hash): each task's image and the api-server service's."""
    tags = []
    for recipe in RECIPES:
        harbor = read_task(root / recipe)["harbor"]
        tags.append(image_tag(harbor, environment_hash(root / recipe / "environment", str(harbor["name"]))))
    service = root / "multi-container" / "environment" / "api-server"
    tags.append(image_tag({"name": "multi-container-api-server"}, environment_hash(service, "multi-container")[:32]))
    return tags


@pytest.fixture(scope="module")
def dataset(docker_env: DockerEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # noqa: F811
    """The recipes, hashes checked, each Dockerfile's `FROM` naming a suite image (built once per Engine); the
    recipes' own images are absent before and after, so each test module run builds them as published."""
    assert {recipe: changed_files(recipe) for recipe in RECIPES} == {recipe: [] for recipe in RECIPES}
    base, root = base_image(docker_env.url), tmp_path_factory.mktemp("cookbook")
    for recipe in RECIPES:
        images = {"environment/Dockerfile": base, **({SERVICE: python_image(docker_env.url)}
                                                       if recipe == "multi-container" else {})}
        rebase_all(FIXTURES / recipe, root / recipe, images)
    tags = built_tags(root)
    assert all(tag.startswith("rollout-buffer-harbor/") and not tag.endswith(":None") for tag in tags), tags
    for tag in tags:
        remove_image(docker_env.url, tag)
    yield root
    for tag in tags:
        remove_image(docker_env.url, tag)


def test_the_fixtures_are_the_published_files_and_only_from_changes(tmp_path: Path) -> None:
    record = published()
    assert record["repository"] == "https://github.com/harbor-framework/harbor-cookbook"
    assert len(record["commit"]) == 40 and sorted(record["recipes"]) == sorted(RECIPES + REFUSED + WARNED)
    for recipe in RECIPES + REFUSED + WARNED:
        assert changed_files(recipe) == [], recipe  # every file present, every SHA-256 the published one
        dockerfiles = dockerfiles_of(recipe)
        copy = rebase_all(FIXTURES / recipe, tmp_path / recipe, {name: "rollout-buffer-test:x" for name in dockerfiles})
        changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()
                         and p.read_bytes() != (FIXTURES / recipe / p.relative_to(copy)).read_bytes())
        assert changed == dockerfiles, recipe
        for name in dockerfiles:
            before = (FIXTURES / recipe / name).read_text().splitlines()
            after = (copy / name).read_text().splitlines()
            assert [(a, b) for a, b in zip(before, after) if a != b] == [
                (next(x for x in before if x.startswith("FROM ")), "FROM rollout-buffer-test:x")], (recipe, name)
    assert dockerfiles_of("multi-container") == ["environment/Dockerfile", SERVICE]


def test_a_multi_step_task_is_refused_with_every_reason_at_once() -> None:
    assert changed_files("multi-step") == []
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", str(FIXTURES / "multi-step"),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    row = json.loads(done.stdout)["tasks"][0]
    assert done.returncode == 1 and row["ok"] is False, done.stdout + done.stderr
    assert {p["field"]: p["message"] for p in row["problems"]} == {
        "instruction.md": "missing or unreadable (No such file or directory)",
        "task.toml steps": "multi-step tasks are not supported here",
        "tests/test.sh": "missing (the verifier Harbor runs after the agent)"}, row
    assert [w["field"] for w in row["warnings"]] == ["task.toml artifacts"], row


def test_an_entrypoint_the_sandbox_does_not_run_is_reported() -> None:
    """dns-blacklisting's ENTRYPOINT writes /etc/hosts and starts its block server (Harbor runs it, with `sleep
    infinity` as its arguments); the agent's container here runs the sandbox's own, so the check says so."""
    assert changed_files("dns-blacklisting") == []
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", str(FIXTURES), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    rows = {row["task"]: row for row in json.loads(done.stdout)["tasks"]}
    entrypoint = [w for w in rows["dns-blacklisting"]["warnings"] if w["field"] == "environment/Dockerfile ENTRYPOINT"]
    assert rows["dns-blacklisting"]["ok"] and len(entrypoint) == 1, rows["dns-blacklisting"]
    assert entrypoint[0]["message"].startswith("not run here: the agent's container runs the sandbox's own entrypoint")
    assert not any("ENTRYPOINT" in w["field"] for name in RECIPES for w in rows[name]["warnings"])  # none of theirs


def dockerfiles_of(recipe: str) -> list[str]:
    return sorted(str(p.relative_to(FIXTURES / recipe)) for p in FIXTURES.joinpath(recipe).rglob("Dockerfile"))


def test_tasks_check_scores_each_reference_solution_by_its_own_test_sh(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv) -> None:  # noqa: F811
    code, report = check_solutions(dataset, docker_env.url, *grants(mirror))
    rows = {row["task"]: row for row in report["tasks"]}
    assert code == 1 and sorted(rows) == sorted(RECIPES), report  # 1: multi-reward's row is not ok (below)
    for recipe in ("multi-container", "simple-task", "skills"):
        assert (rows[recipe]["solution"], rows[recipe]["mode"], rows[recipe]["ok"]) == ("reward 1", "clean", True), \
            rows[recipe]
    # the compose service was built from its own Dockerfile, pip installing flask through the mirror
    served = set(mirror.served)
    assert {"pypi.org/simple/flask/", "files.pythonhosted.org/packages/flask-3.1.3-py3-none-any.whl",
            "astral.sh/uv/0.9.7/install.sh", "pypi.org/simple/pytest/"} <= served, served
    assert [w["field"] for w in rows["multi-container"]["warnings"]] == [
        "environment/docker-compose.yaml services.api-server.expose"]
    assert [w["field"] for w in rows["skills"]["warnings"]] == ["task.toml [environment] skills_dir"]
    # two rewards and no `reward`: tasks check has no run to name one, so it says so, naming both keys
    reward = rows["multi-reward"]
    assert (reward["solution"], reward["ok"]) == ("failed", False), reward
    message = reward["problems"][0]["message"]
    assert "several rewards ['correctness', 'performance'] and no 'reward'" in message, message
    assert "agent.verify.reward_key" in message and "agent.verify.reward_weights" in message
    # the check picks one as a run does: both rewards weighted, the reference solution scores 1
    code, report = check_solutions(dataset / "multi-reward", docker_env.url, *grants(mirror), "--reward-weights",
                                   '{"correctness": 0.5, "performance": 0.5}')
    assert code == 0 and (report["tasks"][0]["solution"], report["tasks"][0]["mode"]) == ("reward 1", "clean"), report


def test_no_answer_scores_0(dataset: Path, mirror: Mirror, docker_env: DockerEnv, tmp_path: Path) -> None:  # noqa: F811
    for recipe in ("simple-task", "multi-container"):  # the same tasks (images found built), solve.sh answering nothing
        shutil.copytree(dataset / recipe, tmp_path / recipe)
        (tmp_path / recipe / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    # scored under clean only, as a run would score them (not every way in which an answer could score 1)
    code, report = check_solutions(tmp_path, docker_env.url, *grants(mirror), "--verify-mode", "clean")
    assert code == 1 and {row["task"]: row["solution"] for row in report["tasks"]} == \
        {"simple-task": "reward 0", "multi-container": "reward 0"}, report
    for row in report["tasks"]:
        assert row["problems"] == [{"field": "solution", "message": "the reference solution scored 0, not 1"}], row


def test_a_run_with_the_scripted_agent_scores_each_recipe_as_its_tests_do(
        dataset: Path, mirror: Mirror, docker_env: DockerEnv, rollout_engine: Any,  # noqa: F811
        qwen_tokenizer_path: str, tmp_path: Path) -> None:
    agent = {**scripted_agent("solve"), "verify": {"reward_weights": WEIGHTS},
             "sandbox": {"backend": "docker", "options": {"docker_host": docker_env.url, "force_build": True}}}
    with ServerProcess(tmp_path / "data", "--agent-sandbox", "docker", *grants(mirror)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        answer = start_harbor_run(client, dataset, agent, engine_url=rollout_engine.url,
                                  tokenizer_path=qwen_tokenizer_path, prefix="cookbook", num_process=4)
        assert answer.status_code == 200, answer.text
        run_id = answer.json()["run_id"]
        wait_status(client, run_id, "finished", timeout_s=400)
        records = {r["instance_id"]: r for r in drain(client, run_id, len(RECIPES), timeout_s=60)}
    rewards = {name: (r["reward"], r["status"]) for name, r in records.items()}
    # the agent answers simple-task and multi-container (through the service) right, multi-reward fast but
    # case-sensitively, skills not at all: the recipes' own tests score 1, 1, 0.75*0 + 0.25*1 and 0
    assert {name: reward for name, (reward, _) in rewards.items()} == \
        {"simple-task": 1.0, "multi-container": 1.0, "multi-reward": 0.25, "skills": 0.0}, records
    verifier = records["multi-reward"]["extra_info"]["verifier"]
    assert (verifier.get("correctness"), verifier.get("performance")) == (0, 1), verifier
