"""A Harbor task's `storage_mb` bounds what its agent writes into the container's writable root: a hostile
scripted agent that fills the work folder (4 MB at a time, up to 1 GB, then it would end as if done) is
stopped, and the rollout is a counted `disk_limit` failure naming the limit, never a verified reward. Where
the Engine has a disk quota (`StorageOpt`), the quota refuses the writes instead: `agent_exit`, no space."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.agents import docker_storage
from rollout_buffer.agents.docker_sandbox import DockerSandbox
from rollout_buffer.agents.sandbox import Limits
from tests.support.docker_env import DockerEnv, docker_env, docker_sandboxes_of  # noqa: F401 - the session fixture
from tests.support.harbor_tasks import make_dataset, scripted_agent, start_harbor_run
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.runtime_helpers import run_detail, wait_status

pytestmark = pytest.mark.timeout(600)
SERVER = ServerSpec(args=("--agent-sandbox", "docker"))
STORAGE_MB = 64  # make_dataset's tasks say so in their task.toml


def test_an_agent_writing_past_storage_mb_is_stopped_and_counted(server: ServerProcess, client: httpx.Client,
                                                                  tmp_path: Path, docker_env: DockerEnv,  # noqa: F811
                                                                  rollout_engine: Any,
                                                                  qwen_tokenizer_path: str) -> None:
    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    for other in ("fix-bug", "partial", "no-reward"):
        shutil.rmtree(dataset / other)
    assert f"storage_mb = {STORAGE_MB}" in (dataset / "hello" / "task.toml").read_text()
    agent = {**scripted_agent("fill"), "sandbox": {"backend": "docker", "options": {"docker_host": docker_env.url}}}
    answer = start_harbor_run(client, dataset, agent, engine_url=rollout_engine.url,
                              tokenizer_path=qwen_tokenizer_path, prefix="harbor-disk")
    assert answer.status_code == 200, answer.text
    run_id = answer.json()["run_id"]
    wait_status(client, run_id, "finished", timeout_s=400)
    failures = run_detail(client, run_id)["failures"]
    assert failures["total"] == 1, failures
    [(kind, failure)] = failures["by_type"].items()
    if kind == "disk_limit":  # watched: stopped once its writable layer passed the limit
        assert f"storage_mb={STORAGE_MB} MB and was stopped" in failure["example"], failure
        assert f"passed disk_mb={STORAGE_MB}" in failure["example"], failure  # the sandbox's note, in the tail
    else:  # the Engine's quota refused the writes
        assert kind == "agent_exit" and "No space left on device" in failure["example"], failures
    assert '"wrote_mb": 1024' not in failure["example"], "it never wrote what it meant to"
    assert not docker_sandboxes_of(docker_env, run_id), "every container was removed"


def test_a_writable_root_is_bounded_by_quota_or_watched(docker_env: DockerEnv) -> None:  # noqa: F811
    """The sandbox itself: a command filling the image's work folder past `disk_mb` is stopped (watched) or
    refused (quota); one that writes less is left alone; the tmpfs home is bounded by the kernel."""

    async def scenario() -> None:
        box = await DockerSandbox(name="disk", limits=Limits(pids=64, disk_mb=16),
                                  options={**docker_env.options(), "image_root": True, "workdir": "/app"})
        try:
            small = await box.exec(["sh", "-c", "head -c 4000000 /dev/zero > small.bin && echo ok"], timeout_s=60)
            assert small.exit_code == 0 and small.stdout.strip() == "ok", small
            fill = await box.exec(["sh", "-c", "i=0; while [ $i -lt 256 ]; do head -c 1048576 /dev/zero > f$i "
                                               "|| exit 3; i=$((i+1)); sleep 0.02; done; echo all"], timeout_s=120)
            assert "all" not in fill.stdout, fill
            if box.storage_watched:
                assert fill.extra.get("stopped_by") == "disk_mb" and fill.exit_code == 137, fill
                assert "passed disk_mb=16" in fill.stderr and not fill.timed_out, fill
            else:
                assert fill.exit_code == 3 and "No space left" in fill.stderr, fill
            home = await box.exec(["sh", "-c", "head -c 40000000 /dev/zero > $HOME/big.bin"], timeout_s=60)
            assert home.exit_code != 0 and "No space left" in home.stderr, home
        finally:
            await box.cleanup()

    asyncio.run(scenario())


def test_quota_refusals_are_told_from_other_failures() -> None:
    refusal = "--storage-opt is supported only for overlay over xfs with 'pquota' mount option"
    assert docker_storage.is_quota_refusal(RuntimeError(refusal))
    assert not docker_storage.is_quota_refusal(RuntimeError("No such image: rollout-buffer-test-base"))
    spec = {"Image": "x", "HostConfig": {"Memory": 1}}
    assert docker_storage.with_quota(spec, 64)["HostConfig"] == {"Memory": 1, "StorageOpt": {"size": "64m"}}
    assert "StorageOpt" not in spec["HostConfig"]
