"""The container a Harbor task's tests run in, per mode (docker backend).

* `clean`: a fresh container of the task's image (the agent's limits, no model socket). The image's work
  folder is emptied there and the agent's work folder copied in through the Engine's archive API (streamed,
  links kept as links, nothing followed), then each of the task's outputs the same way (a path the agent
  did not leave is absent there too). Nothing else of the agent's container comes along: no process, no
  file it planted elsewhere, nothing in /tmp or its home.
* `snapshot`: the agent's container is committed (paused while it is) to an image of its own, and a fresh
  container made from it: every file the agent changed on the container's root comes along, no process can
  (a commit holds files only). Its tmpfs folders (its home, /tmp, /dev/shm) are not part of a commit. The
  image is removed after.
* `same`: the agent's own container (Harbor's semantics), once every process of the agent in it (its user's;
  for a root agent every one but the container's own, `docker_procs`) is killed and shown gone; the weakest:
  whatever the agent wrote anywhere it could is still there.

A failure here (the Engine, a commit, a copy) is the infrastructure's (`SandboxError`): it happens before
test.sh starts.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiodocker.exceptions import DockerError

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents.docker_sandbox import DockerSandbox
from rollout_buffer.agents.sandbox import SandboxError

SNAPSHOT_REPOSITORY = "rollout-buffer-snapshot"
SNAPSHOT_LABEL = "rollout-buffer.snapshot"  # the sandbox's name (its run id first) on each snapshot image
COPY_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)


async def image_env(agent: DockerSandbox) -> list[str]:
    """The task image's own variables (its config: the task author's, never the agent's)."""
    docker = engine.connect(agent.options)
    try:
        found = await docker.images.inspect(agent.image)
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error(f"inspect image {agent.image!r}", exc) from exc
    finally:
        await docker.close()
    return list((found.get("Config") or {}).get("Env") or [])


async def _copy(docker: Any, source: str, target: str, path: str) -> bool:
    """Stream `path` of container `source` into container `target` (same place); False when absent."""
    parent = posixpath.dirname(path) or "/"
    try:
        async with docker._query(f"containers/{source}/archive", params={"path": path},
                                 timeout=COPY_TIMEOUT) as out:
            async with docker._query(f"containers/{target}/archive", "PUT", params={"path": parent},
                                     data=out.content.iter_chunked(1 << 16), timeout=COPY_TIMEOUT,
                                     headers={"content-type": "application/x-tar"}):
                pass
    except DockerError as exc:
        if exc.status == 404:  # the agent left nothing there
            return False
        raise engine.engine_error(f"copy {path} into the verifier's container", exc) from exc
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error(f"copy {path} into the verifier's container", exc) from exc
    return True


async def copy_work(agent: DockerSandbox, box: DockerSandbox, paths: list[str]) -> dict[str, bool]:
    """Each path (the work folder first) emptied in `box`, then copied from the agent's container if there."""
    copied: dict[str, bool] = {}
    docker = engine.connect(agent.options)
    try:
        for path in dict.fromkeys(paths):
            parent = posixpath.dirname(path) or "/"
            clear = await box.exec_root(["sh", "-c", 'rm -rf -- "$1" && mkdir -p -- "$2"', "sh", path, parent],
                                        timeout_s=120)
            if not clear.ok:
                raise SandboxError(f"cannot empty {path} in the verifier's container (exit {clear.exit_code}): "
                                   f"{clear.stderr[-300:]}")
            assert agent.container_id and box.container_id
            copied[path] = await _copy(docker, agent.container_id, box.container_id, path)
    finally:
        await docker.close()
    return copied


async def commit(agent: DockerSandbox) -> str:
    """The agent's container's root filesystem as an image of its own (paused while it is committed)."""
    docker = engine.connect(agent.options)
    tag = uuid.uuid4().hex[:16]
    try:
        await docker._query_json("commit", "POST", params={
            "container": agent.container_id, "repo": SNAPSHOT_REPOSITORY, "tag": tag, "pause": "1",
            "comment": "rollout-buffer verifier snapshot", "changes": f"LABEL {SNAPSHOT_LABEL}={agent.name[:200]}"},
            data="{}", timeout=COPY_TIMEOUT)
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error("commit the agent's container", exc) from exc
    finally:
        await docker.close()
    return f"{SNAPSHOT_REPOSITORY}:{tag}"


async def remove_image(agent: DockerSandbox, image: str) -> None:
    docker = engine.connect(agent.options)
    try:
        with contextlib.suppress(*engine.ENGINE_ERRORS):
            await docker.images.delete(image, force=True)
    finally:
        await docker.close()


async def engine_answers(agent: DockerSandbox) -> bool:
    """Whether the Engine answers (a verifier container that died while the Engine is up died of its tests)."""
    docker = engine.connect(agent.options)
    try:
        await docker.version()
        return True
    except engine.ENGINE_ERRORS:
        return False
    finally:
        await docker.close()


@contextlib.asynccontextmanager
async def verifier_box(agent: DockerSandbox, mode: str, outputs: list[str],
                       egress_socket: str | None = None) -> AsyncIterator[DockerSandbox]:
    """The container the tests run in for `mode` (module docstring); removed after (never the agent's). A
    multi-container task's verifier joins the agent's group (its loopback, where the sidecars are), once the
    agent's processes are shown gone; `egress_socket`: the verifier phase's egress proxy, served in the box."""
    if mode == "same" or agent.sidecars:
        if not await agent.kill_agent_processes():
            raise SandboxError("docker: the agent's processes could not be shown gone before its tests")
    if mode == "same":
        yield agent
        return
    image = await commit(agent) if mode == "snapshot" else agent.image
    options = {k: v for k, v in agent.options.items() if k not in ("sidecars", "egress_socket")}
    if agent.sidecars:
        options["network_of"] = agent.network_id  # the group's namespace (its forwarders' holder's, if any)
    if egress_socket is not None:
        options["egress_socket"] = egress_socket
    try:
        box = await DockerSandbox(name=f"{agent.name}-verify", limits=agent.limits,
                                  options={**options, "image": image, "image_root": True, "hand_over": False})
        try:
            if mode == "clean":
                await copy_work(agent, box, [agent.work, *outputs])
            yield box
        finally:
            await box.cleanup()
    finally:
        if mode == "snapshot":
            await remove_image(agent, image)
