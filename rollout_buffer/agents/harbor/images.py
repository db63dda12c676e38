"""A Harbor task's image: its `docker_image`, or built from its `environment/` folder once per content hash.

A built image is tagged `rollout-buffer-harbor/<task>:<hash of environment/>`, so it is built once per task
and content (by the first rollout that needs it; the others of this process wait for that build) and found
in the Engine's cache after that, by every worker and every later run. The build runs through the Engine's
API with no network (`networkmode: none`, nothing pulled: a `FROM` names an image the Engine has), under the
task's `build_timeout_sec`. A failed build raises `BuildFailed`, a `SandboxError`: the rollout is a counted
infrastructure failure of that task, never a reward. A failure is remembered for `FAILED_TTL_S`, so a task's
repeats do not rebuild a broken environment each.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import tarfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents.sandbox import SandboxError

REPOSITORY = "rollout-buffer-harbor"
DEFAULT_WORKDIR = "/app"
FAILED_TTL_S = 300.0
_locks: dict[str, asyncio.Lock] = {}
_failed: dict[str, tuple[float, str]] = {}


class BuildFailed(SandboxError):
    """The task's environment could not be built (the task's, or the Engine's, not the agent's)."""


def image_tag(harbor: dict[str, Any]) -> str:
    """The tag of a task's built image (its name made a valid repository path, and its content hash)."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", str(harbor["name"]).lower()).strip("-._")[:80] or "task"
    return f"{REPOSITORY}/{safe}:{harbor['env_hash']}"


def folder_tar(env_dir: Path) -> bytes:
    """A folder as a tar (links kept as links, nothing outside it followed): a build context, an upload."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(env_dir.rglob("*")):
            tar.add(path, arcname=path.relative_to(env_dir).as_posix(), recursive=False)
    return buffer.getvalue()


async def _inspect(docker: Any, image: str) -> dict[str, Any] | None:
    try:
        return await docker.images.inspect(image)
    except engine.DockerError as exc:
        if exc.status == 404:
            return None
        raise engine.engine_error(f"inspect image {image!r}", exc) from exc
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error(f"inspect image {image!r}", exc) from exc


async def _build(docker: Any, harbor: dict[str, Any], tag: str) -> None:
    params = {"t": tag, "rm": "1", "forcerm": "1", "networkmode": "none", "pull": "0",
              "labels": json.dumps({"rollout-buffer.harbor": "1", "rollout-buffer.task": str(harbor["name"])[:200]})}
    data = await asyncio.to_thread(folder_tar, Path(harbor["dir"]) / "environment")
    log: list[str] = []
    timeout = aiohttp.ClientTimeout(total=harbor["build_timeout_sec"])
    async with docker._query("build", "POST", params=params, headers={"content-type": "application/x-tar"},
                             data=data, timeout=timeout) as response:
        async for raw in response.content:
            try:
                item = json.loads(raw)
            except ValueError:
                continue
            if item.get("error"):
                raise BuildFailed(f"harbor task {harbor['name']!r}: environment/ build failed: "
                                  f"{str(item['error'])[-500:]} (last output: {''.join(log)[-800:]!r})")
            if isinstance(item.get("stream"), str):
                log.append(item["stream"])


async def task_image(harbor: dict[str, Any], options: dict[str, Any]) -> tuple[str, str]:
    """(image, its working folder) for a task: the named image (never pulled), or the built one (built now
    when the Engine lacks it). BuildFailed / SandboxError when there is none to run."""
    image = harbor.get("docker_image") or image_tag(harbor)
    failed = _failed.get(image)
    if failed and time.monotonic() - failed[0] < FAILED_TTL_S:
        raise BuildFailed(failed[1])
    docker = engine.connect(options)
    try:
        found = await _inspect(docker, image)
        if found is None and harbor.get("docker_image"):
            raise SandboxError(f"harbor task {harbor['name']!r}: image {image!r} is not in the Docker Engine "
                               "(images are never pulled: build or load it first)")
        if found is None:
            async with _locks.setdefault(image, asyncio.Lock()):
                found = await _inspect(docker, image)
                if found is None:
                    try:
                        await _build(docker, harbor, image)
                    except BuildFailed as exc:
                        _failed[image] = (time.monotonic(), str(exc))
                        raise
                    except (TimeoutError, asyncio.TimeoutError) as exc:
                        message = (f"harbor task {harbor['name']!r}: environment/ build ran past its "
                                   f"build_timeout_sec {harbor['build_timeout_sec']:g}")
                        _failed[image] = (time.monotonic(), message)
                        raise BuildFailed(message) from exc
                    except engine.ENGINE_ERRORS as exc:
                        raise engine.engine_error(f"build the image of harbor task {harbor['name']!r}", exc) from exc
                    found = await _inspect(docker, image)
                    if found is None:
                        raise BuildFailed(f"harbor task {harbor['name']!r}: the build ended without image {image!r}")
    finally:
        await docker.close()
    workdir = ((found or {}).get("Config") or {}).get("WorkingDir") or DEFAULT_WORKDIR
    return image, workdir
