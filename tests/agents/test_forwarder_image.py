"""A task image without python3 (Terminal-Bench 2's `FROM ubuntu:24.04` tasks) runs with `forwarder_image`: the
forwarders run in a holder container of that image, whose loopback the agent's container, its sidecars and the
verifier's container share. Real Engine, real model relay (its peer-uid check), real egress proxy."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import httpx
import pytest

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents.docker_holder import HOLDER_LABEL
from rollout_buffer.agents.harbor.network import phase_allowlist
from rollout_buffer.agents.harbor.plan import harbor_options
from rollout_buffer.agents.harbor.verify import harbor_verify
from rollout_buffer.agents.pool import Prepared, prepare
from rollout_buffer.agents.sandbox import Limits, SandboxError, open_sandbox
from rollout_buffer.agents.verify.reward import KeptFailure
from rollout_buffer.tasks.harbor import read_task
from tests.agents.test_harbor_compose import SERVICE, compose_task
from tests.agents.test_harbor_network_verify import DONE, index  # noqa: F401 - the stand-in index fixture
from tests.archive.test_reverify_harbor import _cli, answer_host
from tests.support.docker_env import (DockerEnv, container_exists, docker_env,  # noqa: F401 - the session fixture
                                      docker_sandboxes_of)
from tests.support.helpers import ServerProcess
from tests.support.relay import upstream
from tests.support.runtime_helpers import drain, wait_status

pytestmark = pytest.mark.timeout(600)  # the session's first docker test builds the base image
LIMITS = Limits(pids=64, disk_mb=16, memory_bytes=256 << 20, cpus=1.0)
KEY = "sk-rb-run~fwd.secret"
# one HTTP exchange with bash's /dev/tcp (no python3, no curl): `bash -c HTTP bash HOST PORT REQUEST`; exit 7 when
# the connection is refused
HTTP = 'exec 3<>"/dev/tcp/$1/$2" || exit 7; printf "%b" "$3" >&3; cat <&3'
MODEL_CALL = ("POST /v1/chat/completions HTTP/1.0\\r\\nHost: x\\r\\nAuthorization: Bearer stolen\\r\\n"
              "Content-Type: application/json\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
FIND_FORWARDER = 'id -u; for p in /proc/[0-9]*; do grep -qs "forward[e]r[.]py" "$p/cmdline" && echo "found $p"; done; echo end'


@pytest.fixture()
async def gateway() -> AsyncIterator:
    async with upstream() as made:
        yield made


async def _prepared(env: DockerEnv, gateway_url: str, name: str, **options: object) -> Prepared:
    made = await prepare("docker", name=name, limits=LIMITS, upstream=gateway_url, options=env.options(
        image=env.image_without_python(), forwarder_image=env.image, **options))
    assert made.relay is not None
    made.relay.api_key = KEY
    return made


def _body(answer: str) -> dict:
    return json.loads(answer.split("\r\n\r\n", 1)[1])


async def test_without_the_option_a_python_less_image_fails_naming_it(docker_env: DockerEnv,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    name = f"fwd-none-{secrets.token_hex(4)}"
    with pytest.raises(SandboxError) as failed:
        await open_sandbox("docker", name=name, limits=LIMITS, model_socket=str(tmp_path / "model.sock"),
                           options=docker_env.options(image=docker_env.image_without_python()))
    assert "has no working python3" in str(failed.value)
    assert "set the sandbox option forwarder_image / --forwarder-image to an image with python3" in str(failed.value)
    assert docker_sandboxes_of(docker_env, name) == []
    missing = f"fwd-missing-{secrets.token_hex(4)}"
    with pytest.raises(SandboxError, match="forwarder_image 'rollout-buffer-no-such-image:0', which is not in the"):
        await open_sandbox("docker", name=missing, limits=LIMITS, model_socket=str(tmp_path / "model.sock"),
                           options=docker_env.options(image=docker_env.image_without_python(),
                                                      forwarder_image="rollout-buffer-no-such-image:0"))
    assert docker_sandboxes_of(docker_env, missing) == []
    with pytest.raises(SandboxError, match="is not in the Docker Engine"):  # the holder was up: it goes too
        await open_sandbox("docker", name=missing, limits=LIMITS, model_socket=str(tmp_path / "model.sock"),
                           options=docker_env.options(image="rollout-buffer-no-such-image:0",
                                                      forwarder_image=docker_env.image))
    assert docker_sandboxes_of(docker_env, missing) == []


async def test_a_python_less_image_reaches_the_model_through_a_holder_and_nothing_else(
        docker_env: DockerEnv, gateway) -> None:  # noqa: F811
    name = f"fwd-model-{secrets.token_hex(4)}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # a host-loopback port: the container's loopback is the holder's, not the host's
    prepared = await _prepared(docker_env, gateway.url, name, image_root=True)  # a root agent, as Harbor's default
    box = prepared.sandbox
    try:
        holder = box.network_id
        assert holder != box.container_id and box.model_url == "http://127.0.0.1:8765"
        assert len(docker_sandboxes_of(docker_env, name)) == 2  # the agent's container and its holder
        no_python = await box.exec(["sh", "-c", "command -v python3 || echo none"], timeout_s=30)
        assert no_python.stdout == "none\n"
        call = await box.exec(["bash", "-c", HTTP, "bash", "127.0.0.1", "8765", MODEL_CALL], timeout_s=30)
        assert call.ok, call.stderr
        seen = _body(call.stdout)  # what reached the gateway, through the relay (which admits the keeper uid only)
        assert seen["path"] == "/v1/chat/completions" and seen["auth"] == f"Bearer {KEY}"
        port = str(listener.getsockname()[1])
        refused = await box.exec(["bash", "-c", HTTP, "bash", "127.0.0.1", port, "GET / HTTP/1.0\\r\\n\\r\\n"],
                                 timeout_s=30)
        assert refused.exit_code == 7, refused
        hunt = await box.exec(["bash", "-c", FIND_FORWARDER], timeout_s=30)
        assert hunt.stdout == "0\nend\n", hunt  # root, and no forwarder in its pid namespace to see or kill
        async with aiodocker.Docker(url=docker_env.url) as docker:
            shown = await docker.containers.get(holder)
            top = await docker._query_json(f"containers/{holder}/top")
        assert shown["Config"]["Labels"][HOLDER_LABEL] == "1" and shown["HostConfig"]["NetworkMode"] == "none"
        assert shown["Config"]["User"] == engine.KEEPER_USER and shown["HostConfig"]["CapDrop"] == ["ALL"]
        assert shown["HostConfig"]["ReadonlyRootfs"] and shown["Config"]["Labels"][engine.LABEL] == "1"
        assert shown["HostConfig"]["PidsLimit"] == 64 and shown["HostConfig"]["Memory"] == 256 << 20
        assert any("forwarder.py" in " ".join(row) for row in top["Processes"])  # the forwarder runs, there
        again = await box.exec(["bash", "-c", HTTP, "bash", "127.0.0.1", "8765", MODEL_CALL], timeout_s=30)
        assert _body(again.stdout)["path"] == "/v1/chat/completions"
        assert len(gateway.seen) == 2
    finally:
        await prepared.release()
        listener.close()
    assert not await container_exists(docker_env, holder) and docker_sandboxes_of(docker_env, name) == []


async def test_sidecars_and_the_verifier_share_the_holders_loopback(docker_env: DockerEnv, gateway,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    nopython = docker_env.image_without_python()
    folder = compose_task(tmp_path / "with-api", nopython, SERVICE % docker_env.image)
    (folder / "tests" / "test.sh").write_text(  # the seed by the service's name, from a container without python3
        "#!/bin/bash\nexec 3<>/dev/tcp/api/8080 && printf 'GET /seed.json HTTP/1.0\\r\\n\\r\\n' >&3 && "
        "cat <&3 | grep -q '\"answer\": 42' && r=1 || r=0\ncommand -v python3 && r=0\n"
        "echo $r > /logs/verifier/reward.txt\n")
    sample = read_task(folder)
    name = f"fwd-compose-{secrets.token_hex(4)}"
    options = await harbor_options(sample, docker_env.options(forwarder_image=docker_env.image))
    prepared = await prepare("docker", name=name, limits=Limits(), options=options, upstream=gateway.url)
    box = prepared.sandbox
    try:
        assert box.network_id != box.container_id
        assert len(docker_sandboxes_of(docker_env, name)) == 3  # the agent's container, its holder, its sidecar
        seed = await box.exec(["bash", "-c", HTTP, "bash", "api", "8080", "GET /seed.json HTTP/1.0\\r\\n\\r\\n"],
                              timeout_s=30)
        assert _body(seed.stdout) == {"answer": 42}, seed
        call = await box.exec(["bash", "-c", HTTP, "bash", "127.0.0.1", "8765", MODEL_CALL], timeout_s=30)
        assert _body(call.stdout)["path"] == "/v1/chat/completions"
        verdict = await harbor_verify(box, sample, DONE, mode="clean")  # a fresh container in the agent's group
        assert verdict["reward"] == 1.0, verdict
    finally:
        await prepared.release()
    assert docker_sandboxes_of(docker_env, name) == []


NET_TEST = """#!/bin/bash
command -v python3 && { echo 0 > /logs/verifier/reward.txt; exit 0; }
proxy=${http_proxy#http://}
exec 3<>"/dev/tcp/${proxy%:*}/${proxy##*:}" || { echo 0 > /logs/verifier/reward.txt; exit 0; }
printf 'GET %s HTTP/1.1\\r\\nHost: %s\\r\\nConnection: close\\r\\n\\r\\n' "$INDEX_URL" "$INDEX_HOST" >&3
if cat <&3 | grep -q uv-0.7.13; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


async def test_a_python_less_tasks_verifier_reaches_its_granted_host_through_a_holder(
        docker_env: DockerEnv, index: str, tmp_path: Path) -> None:  # noqa: F811
    root = tmp_path / "needs-index"
    (root / "tests").mkdir(parents=True)
    (root / "instruction.md").write_text("Nothing to do: the tests fetch from the network.\n")
    (root / "task.toml").write_text(
        f'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n'
        f'env = {{ INDEX_URL = "http://{index}/simple/uv/", INDEX_HOST = "{index}" }}\n'
        f'[environment]\ndocker_image = "{docker_env.image_without_python()}"\nallow_internet = true\n')
    (root / "tests" / "test.sh").write_text(NET_TEST)
    sample = read_task(root)
    harbor = sample["harbor"]
    name = f"fwd-verify-{secrets.token_hex(4)}"
    agent = await open_sandbox("docker", name=name, limits=Limits(), options=await harbor_options(
        sample, docker_env.options(forwarder_image=docker_env.image)))
    try:
        granted = phase_allowlist(harbor, "verifier", {"verifier": (index,)})
        verdict = await harbor_verify(agent, sample, DONE, mode="clean", egress=granted)
        assert verdict["reward"] == 1.0 and "network_refused" not in verdict, verdict
        with pytest.raises(KeptFailure) as refused:  # the operator grants the verifier nothing
            await harbor_verify(agent, sample, DONE, mode="clean", egress=phase_allowlist(harbor, "verifier", {}))
        assert refused.value.error_type == "no_network"
        assert refused.value.details["network_refused"] == {index: 1}
        assert len(docker_sandboxes_of(docker_env, name)) == 1  # each verifier's container and holder are gone
    finally:
        await agent.cleanup()
    assert docker_sandboxes_of(docker_env, name) == []


# a RUN step of a python-less image fetching the stand-in index through the build's proxy, with bash's /dev/tcp
BUILD_FETCH = """SHELL ["/bin/bash", "-c"]
RUN p=${HTTP_PROXY#http://}; exec 3<>"/dev/tcp/${p%:*}/${p##*:}" && printf 'GET http://%s/simple/uv/ HTTP/1.1\\r\\nHost: %s\\r\\nConnection: close\\r\\n\\r\\n' INDEX INDEX >&3 && cat <&3 > /fetched.txt && grep -q uv-0.7.13 /fetched.txt
"""


async def test_tasks_check_with_forwarder_image_builds_and_verifies_a_python_less_task(
        docker_env: DockerEnv, index: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from rollout_buffer.agents.harbor.check import cli_main
    from tests.support.registry import remove_image

    def make(task: Path) -> list[str]:
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "solution").mkdir()
        (task / "instruction.md").write_text("Nothing to do.\n")
        (task / "task.toml").write_text(
            f'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n'
            f'env = {{ INDEX_URL = "http://{index}/simple/uv/", INDEX_HOST = "{index}" }}\n'
            f'[environment]\nbuild_timeout_sec = 120.0\nallow_internet = true\n')
        (task / "environment" / "Dockerfile").write_text(
            f"FROM {docker_env.image_without_python()}\n" + BUILD_FETCH.replace("INDEX", index))
        (task / "tests" / "test.sh").write_text(NET_TEST.replace("if cat <&3 | grep -q uv-0.7.13;",
                                                                 "if cat <&3 | grep -q uv-0.7.13 && [ -s /fetched.txt ];"))
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
        return ["check", str(task), "--solutions", "--docker-host", docker_env.url, "--json", "--egress-build", index,
                "--egress-verifier", index]

    name = f"fwd-build-{secrets.token_hex(4)}"
    argv = make(tmp_path / f"{name}-own")  # a task of its own: a failed build is remembered a while, by image
    code = await asyncio.to_thread(cli_main, argv)  # the index answers on this loop meanwhile
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and "base image" in report["tasks"][0]["problems"][0]["message"], report  # its own: no python3
    code = await asyncio.to_thread(cli_main, [*make(tmp_path / name), "--forwarder-image", docker_env.image])
    report = json.loads(capsys.readouterr().out)
    row = report["tasks"][0]
    try:
        assert code == 0 and row["solution"] == "reward 1", row["problems"]
    finally:
        if row["image"].startswith("rollout-buffer-harbor/"):
            remove_image(docker_env.url, row["image"])


# the agent: one chat completion through the model forwarder, with bash's /dev/tcp (the image has no python3)
AGENT = r"""u=${OPENAI_BASE_URL#http://}; hp=${u%%/*}; body='{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}" || exit 7
printf 'POST /%s/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %s\r\nConnection: close\r\n\r\n%s' "${u#*/}" "$OPENAI_API_KEY" "${#body}" "$body" >&3
cat <&3 > /app/answer.txt; head -c 300 /app/answer.txt"""


def test_a_run_on_a_server_with_forwarder_image_scores_a_python_less_task(
        docker_env: DockerEnv, rollout_engine: Any, qwen_tokenizer_path: str, tmp_path: Path) -> None:  # noqa: F811
    task = tmp_path / "dataset" / "no-python"
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text("Ask the model anything; its answer goes to /app/answer.txt.\n")
    (task / "task.toml").write_text(f'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\nnetwork_mode = "public"\n'
                                    f'[agent]\ntimeout_sec = 60.0\n'
                                    f'[environment]\ndocker_image = "{docker_env.image_without_python()}"\n')
    (task / "tests" / "test.sh").write_text("#!/bin/bash\ncommand -v python3 && r=0 || r=1\n"
                                            "grep -q '\"choices\"' /app/answer.txt || r=0\necho $r > /logs/verifier/reward.txt\n")
    run_id = f"fwd-run-{secrets.token_hex(4)}"
    archive = tmp_path / "archive"
    with ServerProcess(tmp_path / "data", "--agent-sandbox", "docker", "--forwarder-image", docker_env.image,
                       "--archive-dir", str(archive), "--archive-interval-s", "0.2") as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/start_rollout", json={
            "task_type": "agent_command", "input_file": str(tmp_path / "dataset"), "num_repeat_per_sample": 1,
            "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path, "run_id": run_id,
            "sampling_params": {"max_tokens": 4, "temperature": 1.0},
            "agent": {"command": ["bash", "-c", AGENT.replace("{", "{{").replace("}", "}}")], "api": "openai",
                      "verify": {"mode": "clean", "keep_work": True},
                      "sandbox": {"backend": "docker", "options": {"docker_host": docker_env.url}}}})
        assert answer.status_code == 200, answer.text
        missing = client.post("/start_rollout", json={  # a run's own forwarder_image the Engine lacks: refused
            "task_type": "agent_command", "input_file": str(tmp_path / "dataset"), "run_id": f"{run_id}-missing",
            "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path,
            "agent": {"command": ["true"], "sandbox": {"backend": "docker", "options": {
                "docker_host": docker_env.url, "forwarder_image": "rollout-buffer-no-such-image:0"}}}})
        assert missing.status_code == 400 and "options.forwarder_image 'rollout-buffer-no-such-image:0' is not an " \
            "image in the Docker Engine" in missing.text, missing.text
        wait_status(client, answer.json()["run_id"], "finished", timeout_s=300)
        records = drain(client, answer.json()["run_id"], 1, timeout_s=60)
        deadline = time.monotonic() + 60
        while client.get(f"/runs/{run_id}").json()["archive"]["archived"] < 1:
            assert time.monotonic() < deadline, "the archive did not catch up"
            time.sleep(0.2)
    assert records[0]["reward"] == 1.0, records[0]["extra_info"]
    assert "HTTP/1.1 200" in records[0]["extra_info"]["agent"]["stdout_tail"], records[0]["extra_info"]["agent"]
    assert docker_sandboxes_of(docker_env, run_id) == []  # the agent's container, its holder, the verifier's: gone
    # re-verified with tests that fetch from a granted host: through a holder with --forwarder-image, else failed
    with answer_host("ok") as host:
        fetching = tmp_path / "fetching-tests"
        fetching.mkdir()
        (fetching / "test.sh").write_text(NET_TEST.replace("grep -q uv-0.7.13", "grep -qx ok").replace(
            '"$INDEX_URL" "$INDEX_HOST"', f'"http://{host}/answer" "{host}"'))
        common = (run_id, "--archive-dir", str(archive), "--harbor-tasks", str(tmp_path / "dataset"), "--docker-host",
                  docker_env.url, "--tests", str(fetching), "--egress-verifier", host)
        failed = _cli(*common)
        assert failed["failed"] == 1 and "forwarder_image / --forwarder-image" in failed["examples"][0]["error"], failed
        same = _cli(*common, "--forwarder-image", docker_env.image)
        assert (same["records"], same["unchanged"], same["failed"]) == (1, 1, 0), same
    assert not docker_sandboxes_of(docker_env, "reverify-")


def test_the_server_flag_sets_every_docker_sandboxs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_buffer.cli import build_parser
    from rollout_buffer.settings import Settings

    monkeypatch.setenv("ROLLOUT_BUFFER_FORWARDER_IMAGE", "python:3.12-slim")
    assert Settings().forwarder_image == "python:3.12-slim"
    args = build_parser().parse_args(["worker", "--forwarder-image", "forwarders:1"])
    assert args.forwarder_image == "forwarders:1"
