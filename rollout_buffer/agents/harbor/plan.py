"""A Harbor sample's run settings: the run's `agent` config with the task's own timeout, limits, image and
verifier in place.

The task's `[agent] timeout_sec` is the agent's budget unless the run sets `agent.timeout_s`; its
`[environment.env]` is the agent's environment under the run's own `agent.env`; `cpus` and
`memory_mb` are the container's CPU and memory limits, `storage_mb` bounds each of its writable tmpfs folders
(home, /tmp, /dev/shm) and its writable root (`docker_storage`); the image's own root is writable and its working folder (`WORKDIR`, Harbor's `/app`
by default) is the agent's. Harbor tasks need the docker backend: the verifier runs as root in the task's image,
in the container the run's `agent.verify` mode gives (`agents/verify`; `clean` by default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rollout_buffer.agents.config import AgentConfig, AgentConfigError
from rollout_buffer.tasks.harbor_compose import ComposeError, read_compose
from rollout_buffer.agents.harbor.build_net import BuildEgress
from rollout_buffer.agents.harbor.images import BuildFailed, HostLock, ImageCache, service_image, task_image
from rollout_buffer.agents.harbor.verify import harbor_verifier
from rollout_buffer.agents.sandbox import factory_path

DOCKER = factory_path("docker")


def harbor_config(config: AgentConfig, sample: dict[str, Any],
                  egress: dict[str, tuple[str, ...]] | None = None, egress_proxy: str = "",
                  egress_mirror: tuple[str, ...] = (), work_store: Path | None = None) -> AgentConfig:
    """The run's config for this Harbor task (AgentConfigError when the run's backend cannot run it);
    `work_store`: where kept work products go (the run's archive's `_work/`)."""
    harbor = sample["harbor"]
    if factory_path(config.backend) != DOCKER:
        raise AgentConfigError("agent.sandbox.backend", f"a Harbor task runs in its own image: it needs the docker "
                                                        f"backend, not {config.backend!r}")
    cpus, memory_mb = float(harbor["cpus"]), int(harbor["memory_mb"])
    try:
        group = read_compose(Path(harbor["dir"]) / "environment", compose_variables(harbor, "-"))
    except ComposeError as exc:
        raise AgentConfigError("harbor environment/docker-compose.yaml", str(exc)) from exc
    if group is not None:  # the sidecars' limits count toward the task's: the agent's container gets the rest
        cpus, memory_mb = cpus - group.cpus, memory_mb - group.memory_mb
        if cpus <= 0 or memory_mb < 64:
            raise AgentConfigError("harbor environment/docker-compose.yaml",
                                   f"the sidecars take {group.cpus:g} cpus and {group.memory_mb} MB of the task's "
                                   f"{harbor['cpus']:g} cpus and {harbor['memory_mb']} MB: nothing is left for the "
                                   "agent")
    limits = dataclasses.replace(config.limits, cpus=cpus, memory_bytes=memory_mb << 20,
                                 disk_mb=int(harbor["storage_mb"]))
    timeout = config.timeout_s if "timeout_s" in config.raw else float(harbor["agent_timeout_sec"])
    # the task's [environment.env] under the run's own env (the session's variables always win); its text is
    # taken as is, not as a template of the run's fields
    task_env = {name: value.replace("{", "{{").replace("}", "}}")
                for name, value in (harbor.get("task_env") or {}).items()}
    verifier = harbor_verifier(config.verify, egress or {}, egress_proxy, egress_mirror, work_store)
    return dataclasses.replace(config, limits=limits, timeout_s=timeout, verifier=verifier, pool=0,
                               env={**task_env, **config.env})


async def harbor_options(sample: dict[str, Any], options: dict[str, Any], lock: HostLock | None = None,
                         cache: ImageCache | None = None, build_egress: BuildEgress | None = None) -> dict[str, Any]:
    """The sandbox options for this task: its image (pulled or built now if need be, once per Engine under
    `lock`, a build reaching `build_egress`'s hosts only), its working folder (task.toml's `[environment]
    workdir`, else the image's) and its sidecars."""
    harbor = sample["harbor"]
    image, workdir = await task_image(harbor, options, lock, cache, build_egress)
    extra: dict[str, Any] = {}
    try:
        group = read_compose(Path(harbor["dir"]) / "environment", compose_variables(harbor, image))
    except ComposeError as exc:
        raise BuildFailed(f"harbor task {harbor['name']!r}: {exc}") from exc
    if group is not None:
        extra["sidecars"] = [(sidecar, await service_image(harbor, sidecar, options, lock, cache, build_egress))
                             for sidecar in group.sidecars]
    if harbor.get("agent_user"):  # the run's own `user` wins (an unprivileged agent, when the run asks for one)
        extra["task_user"] = harbor["agent_user"]
    return {**options, "image": image, "workdir": harbor.get("workdir") or workdir, "image_root": True, **extra}


def compose_variables(harbor: dict[str, Any], image: str) -> dict[str, str]:
    """The variables Harbor sets for a task's compose overlay."""
    return {"MAIN_IMAGE_NAME": image, "CONTEXT_DIR": str(Path(harbor["dir"]) / "environment"),
            "CPUS": f"{float(harbor['cpus']):g}", "MEMORY": f"{int(harbor['memory_mb'])}M"}
