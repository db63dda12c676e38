"""Sidecar containers of a multi-container task (`rollout_buffer.tasks.harbor_compose`), started beside a docker sandbox.

Each sidecar joins the sandbox container's network namespace (`NetworkMode: container:<id>`; the forwarders'
holder's when the sandbox has one, which the sandbox container joins too): it shares the
group's only network, its loopback, and has none of its own. It is labelled as a sandbox container of the same
owner and worker life, with its parent's id (`PARENT_LABEL`), so the stale-container sweep removes a sidecar
whose sandbox is gone. No added capability, no new privileges, a pid limit, and its own memory and CPU limits.
A sidecar that cannot be made, or whose healthcheck does not pass in time, is an infrastructure failure
(`SandboxError`): the agent never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import time
from pathlib import Path
from typing import Any

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents.docker_engine import PARENT_LABEL
from rollout_buffer.tasks.harbor_compose import HEALTH_TIMEOUT_S, Sidecar
from rollout_buffer.agents.sandbox import SandboxError

SIDECAR_PIDS = 512


def _files_tar(files: list[tuple[str, str]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for host, target in files:
            data = Path(host).read_bytes()
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sidecar_spec(sidecar: Sidecar, image: str, parent: str, labels: dict[str, str]) -> dict[str, Any]:
    host: dict[str, Any] = {
        "NetworkMode": f"container:{parent}", "Init": True, "Privileged": False, "CapDrop": ["NET_RAW", "MKNOD"],
        "SecurityOpt": ["no-new-privileges"], "PidsLimit": SIDECAR_PIDS, "IpcMode": "private",
        "Memory": sidecar.memory_mb << 20, "MemorySwap": sidecar.memory_mb << 20, "NanoCpus": int(sidecar.cpus * 1e9),
    }
    spec: dict[str, Any] = {"Image": image, "Env": [f"{k}={v}" for k, v in sidecar.env.items()],
                            "Labels": {**labels, PARENT_LABEL: parent, "rollout-buffer.service": sidecar.name},
                            "HostConfig": host}
    if sidecar.command is not None:
        spec["Cmd"] = sidecar.command
    if sidecar.entrypoint is not None:
        spec["Entrypoint"] = sidecar.entrypoint
    if sidecar.working_dir:
        spec["WorkingDir"] = sidecar.working_dir
    if sidecar.user:
        spec["User"] = sidecar.user
    if sidecar.healthcheck:
        spec["Healthcheck"] = sidecar.healthcheck
    return spec


async def start_sidecars(docker: Any, main: Any, sidecars: list[tuple[Sidecar, str]], name: str,
                         made: list[Any], network: str | None = None) -> None:
    """Create and start each (sidecar, image) beside the `main` container, in order, each healthy before the
    next, appending each container to `made` as it is created (the caller removes them, also when this
    raises). A sidecar carries the main container's sandbox labels, and its id as its parent; it joins the network
    namespace of `network` (the sandbox's forwarder holder, `docker_holder.py`), else of the main container."""
    try:
        shown = await main.show()
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error("inspect the sandbox container", exc) from exc
    labels = {k: v for k, v in ((shown.get("Config") or {}).get("Labels") or {}).items() if k.startswith("rollout-buffer.")}
    parent = main.id
    for sidecar, image in sidecars:
        try:
            spec = sidecar_spec(sidecar, image, parent, labels)
            spec["HostConfig"]["NetworkMode"] = f"container:{network or parent}"
            container = await docker.containers.create(spec, name=engine.container_name(f"{name}-{sidecar.name}"))
            made.append(container)
            if sidecar.files:
                data = await asyncio.to_thread(_files_tar, sidecar.files)
                await container.put_archive("/", data)
            await container.start()
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error(f"start sidecar {sidecar.name!r}", exc) from exc
        if sidecar.healthcheck:
            await _healthy(container, sidecar)


async def _healthy(container: Any, sidecar: Sidecar) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        state = (await container.show()).get("State") or {}
        status = (state.get("Health") or {}).get("Status")
        if status == "healthy":
            return
        if not state.get("Running"):
            raise SandboxError(f"docker: sidecar {sidecar.name!r} exited (code {state.get('ExitCode')}) before it "
                               "was healthy")
        if status == "unhealthy" or time.monotonic() > deadline:
            log = ((state.get("Health") or {}).get("Log") or [{}])[-1].get("Output", "")
            raise SandboxError(f"docker: sidecar {sidecar.name!r} is not healthy ({status}) after its healthcheck: "
                               f"{str(log)[-300:]!r}")
        await asyncio.sleep(0.2)


async def remove_sidecars(docker: Any, made: list[Any]) -> None:
    """Remove the sidecars (before their sandbox container: they live in its network namespace)."""
    for container in reversed(made):
        with contextlib.suppress(Exception):
            await engine.remove_container(docker, container)


def service_hosts(sidecars: list[Sidecar]) -> list[str]:
    """The main container's host entries: every service name on the group's loopback."""
    return [f"{s.name}:127.0.0.1" for s in sidecars]
