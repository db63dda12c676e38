"""A Harbor image build's way to the hosts the operator grants it (`--egress-build`), and to nothing else.

Harbor builds a task's image with network, and most published Terminal-Bench 2 Dockerfiles `RUN apt-get install`
or `pip install`. Here a build has no network (`networkmode: none`) unless the operator grants builds hosts. Then
the build gets an egress proxy like a sandbox phase's (`egress.py`: the same allowlist, mirrors and upstream proxy,
refusals counted by host), reached this way:

- a short-lived *holder* container (`docker_holder.py`, as for a docker sandbox's `forwarder_image`) with network
  none (a loopback of its own and nothing else) runs the in-sandbox forwarder (`forwarder.py`) on that loopback,
  relaying to the proxy's unix socket mounted into it;
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents import docker_holder
from rollout_buffer.agents.docker_holder import HolderFailed
from rollout_buffer.agents.egress import Allowlist, EgressProxy, Mirrors
from rollout_buffer.agents.sandbox import EGRESS_PORT

HOLDER_LABEL = "rollout-buffer.build-holder"
PROXY_ARGS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
_FROM = re.compile(r"^[ \t]*FROM[ \t]+(?:--\S+[ \t]+)*(\S+)(?:[ \t]+AS[ \t]+(\S+))?[ \t]*$", re.IGNORECASE | re.MULTILINE)


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
    """The holder's create body (`docker_holder.holder_spec`): network none, the egress forwarder on its loopback."""
    return docker_holder.holder_spec(image, [docker_holder.Forward(EGRESS_PORT, socket_path, "egress")],
                                     lifetime_s=lifetime_s, owner=owner, name=f"build-egress {what}",
                                     labels={HOLDER_LABEL: "1"})


@contextlib.asynccontextmanager
async def build_network(docker: Any, dockerfile: Path, egress: BuildEgress | None, *, timeout_s: float,
                        owner: str, what: str, forwarder_image: str | None = None) -> AsyncIterator[BuildNetwork]:
    """The build's network: none without a grant; with one, an egress proxy and its holder (of `forwarder_image`
    when the sandbox options name one, else of the Dockerfile's base image), removed on exit."""
    if egress is None:
        yield BuildNetwork()
        return
    if forwarder_image:
        image, where = forwarder_image, f"forwarder_image {forwarder_image!r}"
    else:
        image = _base_of(dockerfile)
        where = f"the Dockerfile's base image {image!r}"
    proxy = await EgressProxy(Allowlist.parse(egress.hosts), upstream=egress.upstream or None,
                              mirrors=Mirrors.parse(egress.mirrors)).start()
    holder = None
    try:
        proxy.admit(engine.parse_user(engine.KEEPER_USER)[0])  # the forwarder's uid, and no other
        spec = holder_spec(image, proxy.socket_path, timeout_s + 60.0, owner, what)
        holder = await docker_holder.start_holder(docker, spec, container_name=f"build-egress-{what}",
                                                  describe=f"the build's egress runs its forwarder in {where}")
        url = f"http://127.0.0.1:{EGRESS_PORT}"
        yield BuildNetwork({"networkmode": f"container:{holder.id}",
                            "buildargs": json.dumps({name: url for name in PROXY_ARGS})}, proxy)
    finally:
        if holder is not None:
            await asyncio.shield(docker_holder.remove_holder(docker, holder))
        await proxy.close()


def _base_of(dockerfile: Path) -> str:
    """The base image the build's forwarder runs in without a forwarder_image; HolderFailed when there is none."""
    try:
        image = base_image(dockerfile.read_text(errors="replace"))
    except OSError as exc:
        raise HolderFailed(f"cannot read {dockerfile.name}: {exc}") from exc
    if image is None or "$" in image:
        raise HolderFailed(f"the build's egress runs its forwarder in the Dockerfile's base image, and {dockerfile.name} "
                           f"names {'none' if image is None else repr(image) + ' through a build argument'}")
    return image
