"""Harbor task folders as a run's input, through the docker backend: a folder of tasks (one built from its
environment/Dockerfile) runs with a scripted agent; each record is token-exact against the engine's log, its
reward is what tests/test.sh wrote (reward.txt, or reward.json with its extra keys), a task whose test.sh
writes no reward is a kept, counted reward_missing (never an infrastructure drop), and a hostile agent finds
no test and no solution and cannot plant a reward. Bad task folders are refused at /start_rollout naming task and field.
The server's workers run with `--task-folders fetch`: every task folder they use is the run's copy, fetched by digest
into their host cache (as on a worker host without the dataset), and still never visible to the agent."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.tasks.harbor import environment_hash
from tests.support.docker_env import DockerEnv, docker_env, docker_sandboxes_of  # noqa: F401 - the session fixture
from tests.support.gateway import assert_turns_are_engine_calls, engine_calls_of
from tests.support.harbor_tasks import add_broken_build, make_dataset, scripted_agent, start_harbor_run
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.runtime_helpers import drain, run_detail, wait_status

pytestmark = pytest.mark.timeout(600)
SERVER = ServerSpec(args=("--agent-sandbox", "docker", "--task-folders", "fetch"),
                    env={"ROLLOUT_BUFFER_TASK_FOLDER_CACHE": str(Path(tempfile.gettempdir()) /
                                                                 f"rb-task-folders-{uuid.uuid4().hex[:8]}")})


def _start(client: httpx.Client, dataset: Path, agent: dict[str, Any], env: DockerEnv, engine_url: str,
           tokenizer_path: str, repeats: int = 1) -> httpx.Response:
    agent = {**agent, "sandbox": {"backend": "docker", "options": {"docker_host": env.url}}}
    return start_harbor_run(client, dataset, agent, engine_url=engine_url, tokenizer_path=tokenizer_path,
                            repeats=repeats, num_process=8)


def test_bad_task_folders_are_refused_naming_task_and_field(server: ServerProcess, client: httpx.Client,
                                                            tmp_path: Path, docker_env: DockerEnv,  # noqa: F811
                                                            rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    good = make_dataset(tmp_path / "good", docker_env.image)
    cases = {"instruction.md": lambda t: (t / "instruction.md").unlink(),
             "task.toml [verifier] timeout_sec": lambda t: (t / "task.toml").write_text(
                 (t / "task.toml").read_text().replace("timeout_sec = 60.0", 'timeout_sec = "soon"')),
             "task.toml": lambda t: (t / "task.toml").write_text("[agent\n"),
             "tests/test.sh": lambda t: (t / "tests" / "test.sh").unlink()}
    host = tmp_path / "host"  # a host folder outside the dataset: no task may read or upload it
    host.mkdir()
    (host / "secret.txt").write_text("host-only-ocelot-5501\n")

    def relink(path: Path, target: Path) -> None:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.symlink_to(target)

    def edit(line: str, new: str) -> Any:  # one line of partial's task.toml replaced
        return lambda t: (t / "task.toml").write_text((t / "task.toml").read_text().replace(f"\n{line}\n",
                                                                                          f"\n{new}\n"))

    cases.update({  # links out of the task folder, and task.toml's extremes (issue 42): a 4xx, never a 500
        "instruction.md: is a link to": lambda t: relink(t / "instruction.md", host / "secret.txt"),
        "tests/: is a link to": lambda t: relink(t / "tests", host),
        "solution/solve.sh: is a link to": lambda t: relink(t / "solution" / "solve.sh", host / "secret.txt"),
        "task.toml [environment] memory_mb: must be a finite number > 0, got inf": edit("memory_mb = 512",
                                                                                         "memory_mb = inf"),
        "task.toml [environment] cpus: must be a finite number > 0, got inf": edit("cpus = 1", "cpus = inf"),
        "task.toml [agent] timeout_sec: must be a finite number > 0, got inf": edit("timeout_sec = 120.0",
                                                                                    "timeout_sec = inf"),
        "task.toml [environment] memory_mb: must be at most": edit("memory_mb = 512", "memory_mb = 1000000000"),
        "task.toml [environment] storage_mb: must be at most": edit("storage_mb = 64", "storage_mb = 1e12"),
        "task.toml [environment] cpus: must be at most": edit("cpus = 1", "cpus = 1000")})
    for field, breaks in cases.items():
        dataset = tmp_path / f"bad-{uuid.uuid4().hex[:6]}"
        shutil.copytree(good, dataset, symlinks=True)
        breaks(dataset / "partial")
        answer = _start(client, dataset, scripted_agent("solve"), docker_env, rollout_engine.url, qwen_tokenizer_path)
        assert answer.status_code in (400, 422), answer.text
        assert "task 'partial'" in answer.text and field in answer.text, (field, answer.text)
        assert "host-only-ocelot-5501" not in answer.text
    # a JSONL naming a folder outside its own folder is refused too
    listing = tmp_path / "sub" / "tasks.jsonl"
    listing.parent.mkdir()
    listing.write_text('{"task_dir": "../good/hello"}\n')
    answer = _start(client, listing, scripted_agent("solve"), docker_env, rollout_engine.url, qwen_tokenizer_path)
    assert answer.status_code in (400, 422) and "leaves the JSONL file's folder" in answer.text, answer.text


def test_harbor_tasks_train_with_a_scripted_agent(server: ServerProcess, client: httpx.Client, tmp_path: Path,
                                                  docker_env: DockerEnv, rollout_engine: Any,  # noqa: F811
                                                  qwen_tokenizer_path: str) -> None:
    dataset = add_broken_build(make_dataset(tmp_path / "tasks", docker_env.image))
    # a content of its own, so this run builds fix-bug's image (an Engine's cache from an earlier run would not)
    (dataset / "fix-bug" / "environment" / "nonce.txt").write_text(uuid.uuid4().hex)
    # hello's [environment.env] (Harbor's ${VAR:-default}) for the agent and the tests; a typo and a field not
    # honoured here, named in the answer
    toml, test_sh = dataset / "hello" / "task.toml", dataset / "hello" / "tests" / "test.sh"
    toml.write_text(toml.read_text().replace("[environment]\n", '[environment]\ncpu = 1\nallow_internet = true\n'
                                             'env = { TASK_COLOUR = "${RB_TEST_NO_SUCH_VARIABLE:-teal}" }\n'
                                             'workdir = "/srv/task"\n'))  # over the image's /app
    test_sh.write_text(test_sh.read_text().replace('echo "GREETING=$GREETING"', 'echo "GREETING=$GREETING '
                                                                                 'COLOUR=$TASK_COLOUR"')
                       .replace("/app/hello.txt", "/srv/task/hello.txt"))
    answer = _start(client, dataset, scripted_agent("solve"), docker_env, rollout_engine.url, qwen_tokenizer_path,
                    repeats=2)
    assert answer.status_code == 200, answer.text
    assert answer.json()["warnings_total"] == 3, answer.json()
    assert answer.json()["warnings"][0] == ("task 'hello': task.toml [environment] cpu: unknown key, ignored as "
                                            "Harbor ignores it (did you mean 'cpus'?)")
    # allow_internet = true, while this server grants neither phase a host (--egress-agent, --egress-verifier)
    assert answer.json()["warnings"][1].startswith("task 'hello': network: the task's agent may reach the internet")
    assert answer.json()["warnings"][2].startswith("task 'hello': network: the task's verifier may reach the "
                                                   "internet in Harbor, and this server grants the verifier no host")
    run_id = answer.json()["run_id"]
    assert f"run {run_id}: 3 warning(s) about its tasks: task 'hello': task.toml [environment] cpu" in \
        server.log_path.read_text()  # and in the server's log
    detail = wait_status(client, run_id, "finished", timeout_s=400)
    records = drain(client, run_id, 6, timeout_s=60)  # no-reward's group: all failed (reward_missing), not handed
    by_task: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_task.setdefault(record["instance_id"], []).append(record)
    assert sorted(by_task) == ["fix-bug", "hello", "partial"] and all(len(v) == 2 for v in by_task.values())
    for record in records:
        info = record["extra_info"]
        assert record["status"] in ("completed", "truncated"), info  # truncated: the engine hit max_tokens
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, info["session_id"]))
        assert len(record["turns"]) == 1
        seen = json.loads(info["agent"]["stdout_tail"].strip().splitlines()[-1])
        # the image's working folder (Harbor's default), or the task's own [environment] workdir
        assert seen["cwd"] == ("/srv/task" if record["instance_id"] == "hello" else "/app")
        assert seen["limits"] == {"memory": str(512 << 20), "cpu": "100000"}  # task.toml's limits
    assert [r["reward"] for r in by_task["hello"]] == [1.0, 1.0]
    assert "GREETING=hi there COLOUR=teal" in by_task["hello"][0]["extra_info"]["verifier"]["test_stdout_tail"]
    for record in by_task["hello"]:
        assert json.loads(record["extra_info"]["agent"]["stdout_tail"].strip().splitlines()[-1])["task_colour"] == \
            "teal"  # [environment.env] reached the agent too
    for record in records:  # each task's [metadata], through a read
        assert record["extra_info"]["metadata"] == {"difficulty": "easy", "tags": ["test"]}, record["extra_info"]
    assert [r["reward"] for r in by_task["fix-bug"]] == [1.0, 1.0]  # its image was built from environment/
    for record in by_task["partial"]:  # non-binary, extra keys kept
        assert record["reward"] == 0.5
        assert record["extra_info"]["verifier"]["passed"] == 1 and record["extra_info"]["verifier"]["total"] == 2
    failures = detail["failures"]
    assert failures["by_type"]["reward_missing"]["count"] == 2, failures  # kept: the agent's, not infrastructure
    assert "wrote no reward" in failures["by_type"]["reward_missing"]["example"]
    # a build that fails is the infrastructure's failure of that task: counted, its group dropped, no reward
    assert failures["by_type"]["sandbox_error"]["count"] == 2, failures
    assert "build failed" in failures["by_type"]["sandbox_error"]["example"]
    drops = run_detail(client, run_id)["drops"]  # counted as the groups were read
    assert drops["sandbox_error"] == 1, drops  # broken-build's group: never trained on
    # the built image stays in the Engine's cache, tagged by its environment's content hash: built once
    tag = f"rollout-buffer-harbor/fix-bug:{environment_hash(dataset / 'fix-bug' / 'environment')}"
    assert image_present(docker_env, tag)
    remove_image(docker_env, tag)  # the next run builds its own
    assert not docker_sandboxes_of(docker_env, run_id), "every container was removed"


def test_hostile_agent_finds_no_tests_or_solution_and_plants_no_reward(
        server: ServerProcess, client: httpx.Client, tmp_path: Path, docker_env: DockerEnv,  # noqa: F811
        rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    shutil.rmtree(dataset / "fix-bug")
    # no-reward's test.sh writes no reward; in an image that leaves /tests and /logs/verifier open to everyone the
    # agent plants one there: had they not been emptied, the planted reward would count
    # (and open-doors, hello in the same image, shows the plants land there)
    shutil.copytree(dataset / "hello", dataset / "open-doors")
    for doors in (dataset / "no-reward", dataset / "open-doors"):
        toml = doors / "task.toml"
        toml.write_text("\n".join(line for line in toml.read_text().splitlines()
                                   if not line.startswith("docker_image")))
        (doors / "environment").mkdir()
        (doors / "environment" / "Dockerfile").write_text(
            f"FROM {docker_env.image}\nRUN mkdir -p /logs/verifier /tests && chmod 0777 /logs /logs/verifier /tests\n")
    answer = _start(client, dataset, scripted_agent("hostile"), docker_env, rollout_engine.url, qwen_tokenizer_path)
    assert answer.status_code == 200, answer.text
    wait_status(client, answer.json()["run_id"], "finished", timeout_s=300)
    records = drain(client, answer.json()["run_id"], 3, timeout_s=60)
    assert sorted(r["instance_id"] for r in records) == ["hello", "open-doors", "partial"]
    detail = run_detail(client, answer.json()["run_id"])
    failures = detail["failures"]["by_type"]
    assert failures["reward_missing"]["count"] == 1 and "wrote no reward" in failures["reward_missing"]["example"]
    assert int(detail["stats"]["task_folders_fetched"]) >= 1  # open-doors' folder came from the run's copy
    for record in records:
        info = record["extra_info"]
        report = json.loads(info["agent"]["stdout_tail"].strip().splitlines()[-1])
        assert report["uid"] == 0  # Harbor's default: the agent is root in its container
        assert report["secret_hits"] == [], report  # no test or solution content anywhere it can read
        if record["instance_id"] == "open-doors":
            assert report["found"] == ["/tests"], report  # the image's empty folder, nothing in it
            assert {"/logs/verifier/reward.txt", "/tests/test.sh"} <= set(report["planted"]), report
            assert "GREETING=hi there" in info["verifier"]["test_stdout_tail"]  # the task's own test.sh ran
        else:
            assert report["found"] == [], report  # no tests/, no solution/, no test.sh anywhere (root reads all)
        assert record["reward"] == 0.0, (record["instance_id"], info["verifier"])  # what test.sh wrote, nothing else


def image_present(env: DockerEnv, tag: str) -> bool:
    import asyncio

    from rollout_buffer.agents.docker_engine import image_exists

    return asyncio.run(image_exists(tag, {"docker_host": env.url}))


def test_a_harbor_dataset_trains_through_slimes_adapter(server: ServerProcess, client: httpx.Client, tmp_path: Path,
                                                        docker_env: DockerEnv, rollout_engine: Any,  # noqa: F811
                                                        qwen_tokenizer_path: str) -> None:
    """slime's own arguments: `--prompt-data` the dataset folder, the agent in `--agent-start-options`."""
    from types import SimpleNamespace

    from slime_adapter.reading.buffer_client import start_rollout
    from slime_adapter.samples.build import build_group_samples

    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    for name in ("fix-bug", "no-reward"):
        shutil.rmtree(dataset / name)
    agent = {**scripted_agent("solve"), "sandbox": {"backend": "docker", "options": {"docker_host": docker_env.url}}}
    run_id = f"harbor-slime-{uuid.uuid4().hex[:8]}"
    args = SimpleNamespace(
        agent_rollout_buffer_url=server.url, prompt_data=str(dataset), rollout_task_type="agent_command",
        n_samples_per_prompt=2, rollout_batch_size=2, num_epoch=1, hf_checkpoint=qwen_tokenizer_path,
        rollout_max_response_len=16, rollout_temperature=1.0, rollout_top_p=1.0, rollout_num_process=8,
        agent_rollout_run_id=run_id, sglang_router_ip="127.0.0.1",
        sglang_router_port=int(rollout_engine.url.rsplit(":", 1)[1]),
        agent_start_options=json.dumps({"agent": agent}))
    answer = start_rollout(server.url, args, None)
    assert answer["run_id"] == run_id, answer
    wait_status(client, run_id, "finished", timeout_s=300)
    records = drain(client, run_id, 4, timeout_s=60)
    assert {r["instance_id"]: r["reward"] for r in records} == {"hello": 1.0, "partial": 0.5}
    samples, stats = build_group_samples(records, lambda: pytest.fail("the token path needs no tokenizer"))
    assert stats.token_path_records == 4 and len(samples) == 4
    for sample in samples:  # task.toml's [metadata] is each Sample's metadata, beside the buffer's own keys
        assert sample.metadata["difficulty"] == "easy" and sample.metadata["tags"] == ["test"], sample.metadata
        assert sample.metadata["instance_id"] in ("hello", "partial")


def remove_image(env: DockerEnv, tag: str) -> None:
    import asyncio

    import aiodocker

    async def remove() -> None:
        async with aiodocker.Docker(url=env.url) as docker:
            await docker.images.delete(tag, force=True)

    asyncio.run(remove())


# A stand-in for slime's `train.py`, run by scripts/run_agent.sh: slime's own rollout arguments as parsed
# (unknown flags ignored), the run started through the adapter as slime's first rollout would start it, the
# run's groups read back and built into samples; prints each instance's rewards.
HARBOR_TRAIN = """
import argparse, json, sys, time, urllib.request
from types import SimpleNamespace
from slime_adapter.reading.buffer_client import start_rollout
from slime_adapter.samples.build import build_group_samples
parser = argparse.ArgumentParser()
for flag in ("--rollout-buffer-url", "--prompt-data", "--rollout-task-type", "--hf-checkpoint", "--agent-start-options",
             "--agent-rollout-run-id", "--sglang-router-ip"):
    parser.add_argument(flag)
parser.add_argument("--sglang-router-port", type=int)
parser.add_argument("--n-samples-per-prompt", type=int)
a, _ = parser.parse_known_args()
args = SimpleNamespace(agent_rollout_buffer_url=a.rollout_buffer_url, prompt_data=a.prompt_data,
                       rollout_task_type=a.rollout_task_type, n_samples_per_prompt=a.n_samples_per_prompt,
                       rollout_batch_size=2, num_epoch=1, hf_checkpoint=a.hf_checkpoint, rollout_max_response_len=16,
                       rollout_temperature=1.0, rollout_top_p=1.0, rollout_num_process=8,
                       agent_rollout_run_id=a.agent_rollout_run_id, sglang_router_ip=a.sglang_router_ip,
                       sglang_router_port=a.sglang_router_port, agent_start_options=a.agent_start_options)
run_id = start_rollout(a.rollout_buffer_url, args, None)["run_id"]
records, deadline = [], time.monotonic() + 300
while len(records) < 4 and time.monotonic() < deadline:
    body = json.dumps({"run_id": run_id, "wait_s": 5}).encode()
    request = urllib.request.Request(a.rollout_buffer_url + "/get_rollout_data", data=body,
                                     headers={"Content-Type": "application/json"})
    records += json.load(urllib.request.urlopen(request, timeout=30))["data"]["data"]
samples, stats = build_group_samples(records, lambda: sys.exit("the token path needs no tokenizer"))
print(json.dumps({"rewards": {r["instance_id"]: r["reward"] for r in records}, "samples": len(samples),
                  "token_path": stats.token_path_records}), flush=True)
"""


def test_a_harbor_dataset_trains_with_run_agent_sh(tmp_path: Path, docker_env: DockerEnv,  # noqa: F811
                                                   rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    """`scripts/run_agent.sh --agent-sandbox docker -- python train.py --prompt-data DATASET ...`: the buffer
    it starts reads the dataset (the training command's data folder is an input root) and trains it."""
    import os
    import subprocess
    import sys

    from tests.support.helpers import REPO, free_port

    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    for name in ("fix-bug", "no-reward"):
        shutil.rmtree(dataset / name)
    agent = {**scripted_agent("solve"), "sandbox": {"backend": "docker", "options": {"docker_host": docker_env.url}}}
    (tmp_path / "train.py").write_text(HARBOR_TRAIN)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUFFER_")}
    env.update(PYTHON=sys.executable, BUFFER_PORT=str(port), ROLLOUT_BUFFER_DATA_DIR=str(tmp_path / "data"),
               HEALTH_TIMEOUT_S="90", STOP_TIMEOUT_S="30", PYTHONPATH=str(REPO))
    engine_port = rollout_engine.url.rsplit(":", 1)[1]
    done = subprocess.run(
        [str(REPO / "scripts" / "run_agent.sh"), "--agent-sandbox", "docker", "--input-root", qwen_tokenizer_path,
         "--", sys.executable, str(tmp_path / "train.py"), "--prompt-data", str(dataset),
         "--rollout-task-type", "agent_command", "--n-samples-per-prompt", "2", "--hf-checkpoint", qwen_tokenizer_path,
         "--agent-rollout-run-id", f"harbor-sh-{uuid.uuid4().hex[:6]}", "--sglang-router-ip", "127.0.0.1",
         "--sglang-router-port", engine_port, "--agent-start-options", json.dumps({"agent": agent})],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"rewards": {"hello": 1.0, "partial": 0.5}, "samples": 4, "token_path": 4}, report
