"""Harbor tasks: from `/start_rollout` to the first group handed over, 8 tasks x 4 repeats, each task's image
built from its environment/Dockerfile: images not yet built (each task's environment is new, so every image
is built by the run) against the same dataset started again (every image found in the Engine's cache).

Everything is real: a `rollout-buffer serve` process with the docker backend, the test engine, the scripted
agent of the test suite (one model call, then its work), containers with no network, tests/test.sh as the
verifier. The ratio is uncached / cached: how much the image cache saves a run's first group. Needs a Docker
Engine and the test suite's base image (run tests/agents/test_harbor_tasks.py once), else it is skipped.

    python -m bench.harbor_start
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

TASKS, REPEATS = 8, 4


def _dataset(root: Path, base_image: str) -> Path:
    """8 tasks built from a Dockerfile on the base image; a nonce makes every environment (and image) new."""
    nonce = uuid.uuid4().hex
    for i in range(TASKS):
        task = root / f"task-{i}"
        for name, text in {
            "instruction.md": f"Create /app/out-{i}.txt.\n",
            "task.toml": '[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n[environment]\nmemory_mb = 512\n',
            "environment/Dockerfile": f"FROM {base_image}\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\nRUN true\n",
            "environment/seed.txt": f"{nonce}-{i}\n",
            "tests/test.sh": f"#!/bin/bash\n[ -f /app/seed.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 "
                             "> /logs/verifier/reward.txt\n"}.items():
            path = task / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return root


def _first_group_s(client: httpx.Client, body: dict[str, Any]) -> float:
    started = time.monotonic()
    answer = client.post("/start_rollout", json=body)
    answer.raise_for_status()
    while time.monotonic() - started < 600:
        read = client.post("/get_rollout_data", json={"run_id": answer.json()["run_id"], "wait_s": 1.0}).json()
        if read.get("success") and read["data"]["data"]:
            return time.monotonic() - started
    raise TimeoutError("no group within 600 s")


def run(quick: bool = False) -> dict[str, Any]:
    from bench.sandboxes import IMAGE, unavailable
    from rollout_buffer.testing.engine import run_engine_in_thread
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
    from tests.support.harbor_tasks import scripted_agent
    from tests.support.helpers import ServerProcess

    why = unavailable("docker")
    if why:
        return {"skipped": why}
    with TemporaryDirectory() as tmp, run_engine_in_thread(template="qwen2.5", seed=3) as engine, \
            ServerProcess(Path(tmp) / "data", "--agent-sandbox", "docker") as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        dataset = _dataset(Path(tmp) / "tasks", IMAGE["docker"])

        def body() -> dict[str, Any]:
            return {"task_type": "agent_command", "input_file": str(dataset), "num_repeat_per_sample": REPEATS,
                    "num_process": TASKS * REPEATS, "remote_engine_url": engine.url,
                    "tokenizer_path": str(qwen_tokenizer_dir("qwen2.5")), "run_id": f"bench-{uuid.uuid4().hex[:8]}",
                    "sampling_params": {"max_tokens": 16}, "agent": {**scripted_agent("solve"),
                                                                     "sandbox": {"backend": "docker"}}}

        try:
            uncached = _first_group_s(client, body())
            cached = _first_group_s(client, body())
        finally:
            asyncio.run(_remove_images(dataset))
    return {"tasks": TASKS, "repeats": REPEATS, "uncached_s": uncached, "cached_s": cached,
            "ratio": uncached / cached}


async def _remove_images(dataset: Path) -> None:
    """The bench's images go again (each run builds new ones: its environments are new)."""
    import contextlib

    from rollout_buffer.agents import docker_engine
    from rollout_buffer.agents.harbor.images import image_tag
    from rollout_buffer.tasks.harbor import read_task

    docker = docker_engine.connect({})
    try:
        for folder in sorted(dataset.iterdir()) if dataset.exists() else []:
            with contextlib.suppress(Exception):
                await docker.images.delete(image_tag(read_task(folder)["harbor"]), force=True)
    finally:
        await docker.close()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    print(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
