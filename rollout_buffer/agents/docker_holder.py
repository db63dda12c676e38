"""A holder container: a network namespace of its own, with the in-sandbox forwarders on its loopback.

The forwarder (`forwarder.py`) needs python3, and many published task images have none (Terminal-Bench 2's
`FROM ubuntu:24.04` tasks). A holder runs the forwarders from another image (a docker sandbox's
`forwarder_image`, or an image build's base image: `harbor/build_net.py`), and the container that needs them is
created with `NetworkMode: container:<holder id>`: it shares the holder's loopback, so `127.0.0.1:PORT` reaches
each forwarder as before, and nothing else (the holder has network none, or joins a group's namespace that has
none). The holder runs as the keeper user (the one uid the model relay and the egress proxies admit) with no
capability, no new privileges, a read-only root and small limits; its processes live in its own pid namespace,
out of the joining container's sight and reach (a root agent's too). It is labelled as a sandbox container (owner,
worker life, deadline), so the stale-container sweep removes one a dead worker left, and its owner removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents import forwarder
from rollout_buffer.agents.sandbox import EGRESS_PORT, MODEL_PORT, SandboxError

HOLDER_LABEL = "rollout-buffer.holder"
HOLDER_START_S = 30.0
FORWARDER = Path(forwarder.__file__)
_SLEEP = "import time; print('ready', flush=True); time.sleep({0})"


class HolderFailed(SandboxError):
    """A holder could not start (its image missing, or without python3)."""


@dataclass(frozen=True)
class Forward:
    """One forwarder: `127.0.0.1:port` in the holder -> `socket_path`, mounted at `MOUNT_DIR/folder`."""

    port: int
    socket_path: str
    folder: str


def holder_spec(image: str, forwards: list[Forward], *, lifetime_s: float, owner: str, name: str,
                labels: dict[str, str] | None = None, network: str = "none",
                extra_hosts: list[str] | None = None) -> dict[str, Any]:
    """The holder's create body: each forwarder bound on its loopback before the next starts (`forwarder.py`'s
    `--` form), and `ready` printed once all are; read-only, no capability, bounded."""
    binds = [f"{FORWARDER}:{engine.MOUNT_DIR}/forwarder.py:ro"]
    chain: list[str] = []
    for fwd in forwards:
        mount = f"{engine.MOUNT_DIR}/{fwd.folder}"
        binds.append(f"{Path(fwd.socket_path).parent}:{mount}:ro")
        chain += ["python3", "-I", f"{engine.MOUNT_DIR}/forwarder.py", str(fwd.port),
                  f"{mount}/{Path(fwd.socket_path).name}", "--"]
    tags = {engine.LABEL: "1", HOLDER_LABEL: "1", engine.OWNER_LABEL: owner, engine.LIFE_LABEL: engine.WORKER_LIFE,
            engine.WORKER_LABEL: engine.worker_id(), engine.DEADLINE_LABEL: str(int(time.time() + lifetime_s)),
            "rollout-buffer.name": name[:200], **(labels or {})}
    host: dict[str, Any] = {
        "NetworkMode": network, "ReadonlyRootfs": True, "Privileged": False, "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges"], "IpcMode": "private", "PidsLimit": 64, "Memory": 256 << 20,
        "MemorySwap": 256 << 20, "NanoCpus": 1_000_000_000, "Binds": binds}
    if extra_hosts:  # names on the shared loopback: a container joining the holder uses the holder's /etc/hosts
        host["ExtraHosts"] = list(extra_hosts)
    return {"Image": image, "Cmd": [], "User": engine.KEEPER_USER, "WorkingDir": "/", "Env": [], "Labels": tags,
            "Entrypoint": [*chain, "python3", "-I", "-c", _SLEEP.format(int(lifetime_s))],
            "NetworkDisabled": False, "Tty": False, "HostConfig": host}


async def wait_ready(container: Any, what: str) -> None:
    """Until the holder printed `ready` (every forwarder listens); HolderFailed if it exits or takes too long."""
    deadline = time.monotonic() + HOLDER_START_S
    while time.monotonic() < deadline:
        logs = "".join(await container.log(stdout=True, stderr=True))
        if "ready" in logs.split():
            return
        state = (await container.show()).get("State") or {}
        if not state.get("Running"):
            raise HolderFailed(f"{what} exited (exit {state.get('ExitCode')}: {logs[-300:]!r})")
        await asyncio.sleep(0.05)
    raise HolderFailed(f"{what} did not start within {HOLDER_START_S:g} s")


async def start_holder(docker: Any, spec: dict[str, Any], *, container_name: str, describe: str) -> Any:
    """Create and start the holder and wait until it is ready; on any failure it is removed and HolderFailed
    says why (`describe` names the image and its role, e.g. "the forwarders run in forwarder_image 'x'")."""
    holder = None
    try:
        try:
            holder = await docker.containers.create(spec, name=engine.container_name(container_name))
            await holder.start()
        except engine.DockerError as exc:
            missing = "is not in the Docker Engine" if exc.status == 404 else "cannot run its python3"
            raise HolderFailed(f"{describe}, which {missing}: {exc.message}") from exc
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error("start the forwarders' holder container", exc) from exc
        await wait_ready(holder, f"the forwarder ({describe})")
        return holder
    except BaseException:
        if holder is not None:
            await asyncio.shield(remove_holder(docker, holder))
        raise


async def sandbox_holder(docker: Any, box: Any) -> Any:
    """A docker sandbox's holder of its `forwarder_image`: its model and egress sockets served, its sidecars' names
    in the hosts file it shares (`docker_sidecars.py`), in the namespace of its `network_of` if it has one; sets the
    sandbox's `model_url` and `egress_url`."""
    forwards = [Forward(MODEL_PORT, box.model_socket, "model")] if box.model_socket else []
    if box.egress_socket:
        forwards.append(Forward(EGRESS_PORT, box.egress_socket, "egress"))
    network_of = box.options.get("network_of")
    spec = holder_spec(box.forwarder_image, forwards, lifetime_s=box.lifetime_s + 60.0, name=f"{box.name}-holder",
                       owner=str(box.options.get("owner") or engine.DEFAULT_OWNER),
                       network=f"container:{network_of}" if network_of else "none",
                       extra_hosts=[f"{sidecar.name}:127.0.0.1" for sidecar, _ in box.sidecars])
    made = await start_holder(docker, spec, container_name=f"{box.name}-holder",
                              describe=f"docker: the forwarders run in forwarder_image {box.forwarder_image!r}")
    for fwd in forwards:
        setattr(box, f"{fwd.folder}_url", f"http://127.0.0.1:{fwd.port}")  # model_url, egress_url
    return made


async def remove_holder(docker: Any, holder: Any) -> None:
    """Remove the holder (after whatever joined its namespace); never raises."""
    with contextlib.suppress(*engine.ENGINE_ERRORS, SandboxError):
        await engine.remove_container(docker, holder)
