"""A Harbor image build's way to the hosts the operator grants it (`--egress-build`), and to nothing else.

Harbor builds a task's image with network, and most published Terminal-Bench 2 Dockerfiles `RUN apt-get install`
or `pip install`. Here a build has no network (`networkmode: none`) unless the operator grants builds hosts. Then
the build gets an egress proxy like a sandbox phase's (`egress.py`: the same allowlist, mirrors and upstream proxy,
refusals counted by host), reached this way:

- a short-lived *holder* container with network none (a loopback of its own and nothing else) runs the in-sandbox
  forwarder (`forwarder.py`) on that loopback, relaying to the proxy's unix socket mounted into it;
- the build runs with `networkmode: container:<holder>` (the Engine's legacy builder gives each RUN step the
  holder's network namespace), so a RUN step reaches that loopback and nothing more: not the host's loopback
  (Redis, the API), not another container;
- Docker's predefined proxy build arguments (`HTTP_PROXY`, `HTTPS_PROXY` and their lower-case forms, which the
  image's history does not keep) point apt, pip and curl at the forwarder.

The holder runs the Dockerfile's base image (its first `FROM` that is not a stage or `scratch`), which must have
python3 for the forwarder, as a sandbox's image must; it runs as the sandbox's keeper user with no capability,
is labelled like a sandbox container (so the stale-container sweep removes one a dead worker left) with a
deadline, and is removed after the build whatever its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents import forwarder
from rollout_buffer.agents.egress import Allowlist, EgressProxy, Mirrors
from rollout_buffer.agents.sandbox import EGRESS_PORT, SandboxError

HOLDER_LABEL = "rollout-buffer.build-holder"
HOLDER_START_S = 30.0
PROXY_ARGS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
FORWARDER = Path(forwarder.__file__)
_FROM = re.compile(r"^[ \t]*FROM[ \t]+(?:--\S+[ \t]+)*(\S+)(?:[ \t]+AS[ \t]+(\S+))?[ \t]*$", re.IGNORECASE | re.MULTILINE)
_SLEEP = "import time; print('ready', flush=True); time.sleep({0})"


class HolderFailed(SandboxError):
    """The build's egress holder could not start (its base image missing, or without python3)."""


@dataclass(frozen=True)
class BuildEgress:
    """What the operator grants image builds: hosts (`--egress-build`), mirrors and the upstream proxy (shared
    with the sandbox phases' egress)."""

    hosts: tuple[str, ...] = ()
    mirrors: tuple[str, ...] = ()
    upstream: str = ""

    @classmethod
    def of(cls, server: Any) -> BuildEgress | None:
        """The grant of a `ServerFacts` (or anything with its egress fields); None when builds get no host."""
        hosts = tuple(getattr(server, "egress_build", ()) or ())
        if not hosts:
            return None
        return cls(hosts, tuple(getattr(server, "egress_mirror", ()) or ()), str(getattr(server, "egress_proxy", "") or ""))


@dataclass
class BuildNetwork:
    """The build's network parameters, and the proxy whose refusals a failure names."""

    params: dict[str, str] = field(default_factory=lambda: {"networkmode": "none"})
    proxy: EgressProxy | None = None

    def refusals(self) -> str:
        """What a failed build's message adds: the hosts its egress refused, or that it had no network at all."""
        if self.proxy is None:
            return " (this build had no network: grant the hosts it downloads from with --egress-build)"
        if not self.proxy.stats.refused:
            return ""
        return f" (the build's egress refused {sorted(self.proxy.stats.refused)}: grant them with --egress-build)"


def base_image(dockerfile: str) -> str | None:
    """The image the Dockerfile's first real stage starts from (not an earlier stage, not `scratch`); None when
    there is none."""
    stages: set[str] = set()
    for match in _FROM.finditer(dockerfile):
        image, alias = match.group(1), match.group(2)
        if image.lower() not in stages and image.lower() != "scratch":
            return image
        if alias:
            stages.add(alias.lower())
    return None


def holder_spec(image: str, socket_path: str, lifetime_s: float, owner: str, what: str) -> dict[str, Any]:
    """The holder's create body: network none, the forwarder on its loopback (bound before `ready` is printed),
    read-only, no capability, bounded."""
    sock = f"{engine.MOUNT_DIR}/egress/{Path(socket_path).name}"
    labels = {engine.LABEL: "1", HOLDER_LABEL: "1", engine.OWNER_LABEL: owner, engine.LIFE_LABEL: engine.WORKER_LIFE,
              engine.WORKER_LABEL: engine.worker_id(), engine.DEADLINE_LABEL: str(int(time.time() + lifetime_s)),
              "rollout-buffer.name": f"build-egress {what}"[:200]}
    host = {"NetworkMode": "none", "ReadonlyRootfs": True, "Privileged": False, "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"], "IpcMode": "private", "PidsLimit": 64,
            "Memory": 256 << 20, "MemorySwap": 256 << 20, "NanoCpus": 1_000_000_000,
            "Binds": [f"{Path(socket_path).parent}:{engine.MOUNT_DIR}/egress:ro",
                      f"{FORWARDER}:{engine.MOUNT_DIR}/forwarder.py:ro"]}
    return {"Image": image, "Cmd": [], "User": engine.KEEPER_USER, "WorkingDir": "/", "Env": [], "Labels": labels,
            "Entrypoint": ["python3", "-I", f"{engine.MOUNT_DIR}/forwarder.py", str(EGRESS_PORT), sock, "--",
                           "python3", "-I", "-c", _SLEEP.format(int(lifetime_s))],
            "NetworkDisabled": False, "Tty": False, "HostConfig": host}


async def _wait_ready(container: Any, image: str) -> None:
    deadline = time.monotonic() + HOLDER_START_S
    while time.monotonic() < deadline:
        logs = "".join(await container.log(stdout=True, stderr=True))
        if "ready" in logs.split():
            return
        state = (await container.show()).get("State") or {}
        if not state.get("Running"):
            raise HolderFailed(f"the build's egress forwarder exited in base image {image!r} (exit "
                               f"{state.get('ExitCode')}: {logs[-300:]!r})")
        await asyncio.sleep(0.05)
    raise HolderFailed(f"the build's egress forwarder did not start within {HOLDER_START_S:g} s")


@contextlib.asynccontextmanager
async def build_network(docker: Any, dockerfile: Path, egress: BuildEgress | None, *, timeout_s: float,
                        owner: str, what: str) -> AsyncIterator[BuildNetwork]:
    """The build's network: none without a grant; with one, an egress proxy and its holder, removed on exit."""
    if egress is None:
        yield BuildNetwork()
        return
    try:
        image = base_image(dockerfile.read_text(errors="replace"))
    except OSError as exc:
        raise HolderFailed(f"cannot read {dockerfile.name}: {exc}") from exc
    if image is None or "$" in image:
        raise HolderFailed(f"the build's egress runs its forwarder in the Dockerfile's base image, and {dockerfile.name} "
                           f"names {'none' if image is None else repr(image) + ' through a build argument'}")
    proxy = await EgressProxy(Allowlist.parse(egress.hosts), upstream=egress.upstream or None,
                              mirrors=Mirrors.parse(egress.mirrors)).start()
    holder = None
    try:
        proxy.admit(engine.parse_user(engine.KEEPER_USER)[0])  # the forwarder's uid, and no other
        spec = holder_spec(image, proxy.socket_path, timeout_s + 60.0, owner, what)
        try:
            holder = await docker.containers.create(spec, name=engine.container_name(f"build-egress-{what}"))
            await holder.start()
        except engine.DockerError as exc:
            missing = "is not in the Docker Engine" if exc.status == 404 else "cannot run its python3"
            raise HolderFailed(f"the build's egress runs its forwarder in the Dockerfile's base image {image!r}, "
                               f"which {missing}: {exc.message}") from exc
        await _wait_ready(holder, image)
        url = f"http://127.0.0.1:{EGRESS_PORT}"
        yield BuildNetwork({"networkmode": f"container:{holder.id}",
                            "buildargs": json.dumps({name: url for name in PROXY_ARGS})}, proxy)
    finally:
        if holder is not None:
            with contextlib.suppress(*engine.ENGINE_ERRORS, SandboxError):
                await asyncio.shield(engine.remove_container(docker, holder))
        await proxy.close()
