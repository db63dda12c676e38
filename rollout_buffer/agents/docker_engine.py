"""Docker Engine plumbing for the docker sandbox: the client, a sandbox container's spec, and housekeeping.

Everything goes through the Engine's HTTP API (`aiodocker`), never the docker CLI. A sandbox container is
built to hold the isolation contract of `sandbox.py` by itself: no network (`NetworkMode: none`), a
read-only root with size-bounded tmpfs for every writable place, no capability, no new privileges, a pid
limit, memory and CPU limits, an init that reaps orphans, and a main process (`timeout LIFETIME cat`, as a
user the agent cannot signal) whose end removes the container (`AutoRemove`). That process reads a stdin the
worker holds attached, so the container goes at its lifetime, at cleanup and as soon as the worker dies
(its connection closes); `remove_stale_containers` sweeps whatever a worker life still left. Labels name every
sandbox container (`rollout-buffer.sandbox=1`), its owner, the worker life and its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from rollout_buffer.agents.sandbox import Limits, SandboxError

DEFAULT_SOCKET = "/var/run/docker.sock"
LABEL = "rollout-buffer.sandbox"
OWNER_LABEL, LIFE_LABEL, DEADLINE_LABEL = "rollout-buffer.owner", "rollout-buffer.life", "rollout-buffer.deadline"
PARENT_LABEL = "rollout-buffer.parent"  # a sidecar's sandbox container (`docker_sidecars.py`)
WORKER_LABEL = "rollout-buffer.worker"  # "pid:start time" of the worker process that made the container
# this process's life: containers labelled with another life of the same owner were left by a dead worker
WORKER_LIFE = uuid.uuid4().hex
# the host a worker's containers belong to: its sweeps remove only what dead workers of this owner left; worker
# hosts that share a host name (network namespaces, cloned machines) each set their own
DEFAULT_OWNER = os.environ.get("ROLLOUT_BUFFER_SANDBOX_OWNER") or socket.gethostname()
# the container's main process and the model forwarder run as this user: the agent cannot signal them
KEEPER_USER = "65534:65534"
# root in a Harbor task's container (its own writable root): what the verifier needs to hand over and empty
# folders, and for a root agent what Harbor-style tasks need besides (apt-get drops to its `_apt` user: SETUID,
# SETGID; a service run as another user is stopped by root: KILL; dpkg keeps file modes: FSETID). No other
# capability: no mount, no raw network, no device, no chroot, no ptrace of what it does not own.
VERIFIER_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER")
ROOT_AGENT_CAPS = (*VERIFIER_CAPS, "FSETID", "KILL", "SETGID", "SETUID")
MOUNT_DIR = "/run/rollout-buffer"  # the forwarder and the model socket's folder, read-only inside
API_TIMEOUT_S = 120.0


def docker_url(options: dict[str, Any] | None = None) -> str:
    """`options["docker_host"]`, else `DOCKER_HOST`, else the default socket, as a URL aiodocker takes."""
    host = (options or {}).get("docker_host") or os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET
    return host if "://" in host else f"unix://{host}"


def connect(options: dict[str, Any] | None = None) -> aiodocker.Docker:
    """A client of the Engine (one aiohttp session; the caller closes it)."""
    try:
        return aiodocker.Docker(url=docker_url(options), timeout=aiohttp.ClientTimeout(total=API_TIMEOUT_S))
    except (ValueError, OSError) as exc:
        raise SandboxError(f"cannot reach the Docker Engine at {docker_url(options)}: {exc}") from exc


def engine_error(action: str, exc: BaseException) -> SandboxError:
    """An Engine failure as the infrastructure error it is (never the agent's)."""
    if isinstance(exc, DockerError) and exc.status != 900:  # aiodocker's 900: no connection to the Engine
        error = SandboxError(f"docker: cannot {action}: {exc.message} (status {exc.status})")
        error.engine_failure = exc.status >= 500  # the Engine's own fault, not the request's (a missing image)
        return error
    error = SandboxError(f"docker: cannot {action}: the Docker Engine is unreachable ({type(exc).__name__}: {exc})")
    error.engine_failure = True  # counted toward pausing the host (rollout_buffer.runtime.host_health)
    return error


ENGINE_ERRORS = (DockerError, aiohttp.ClientError, OSError, TimeoutError)


def parse_user(user: str, *, allow_root: bool = False) -> tuple[int, int]:
    """`"uid[:gid]"` (numeric: the tmpfs folders are made over to it before any passwd file is read). Root only
    where the container's root is the image's own (`allow_root`: a Harbor task's, whose agent is root by
    default); a read-only sandbox's agent is never root."""
    uid, _, gid = str(user).partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise SandboxError(f"docker sandbox option user must be numeric 'uid[:gid]', got {user!r}")
    if int(uid) == 0 and not allow_root:
        raise SandboxError("docker sandbox option user must not be root (uid 0)")
    return int(uid), int(gid or uid)


# "user[:group]" (names or numbers) -> "uid:gid", through the image's own passwd and group files
RESOLVE_USER = ('u=${1%%:*}; g=${1#"$u"}; g=${g#:}; uid=$(id -u -- "$u") || exit 3; '
            'if [ -z "$g" ]; then gid=$(id -g -- "$u"); else case $g in *[!0-9]*) '
            'gid=$(getent group -- "$g" | cut -d: -f3);; *) gid=$g;; esac; fi; '
            '[ -n "$gid" ] || exit 4; echo "$uid:$gid"')


def numeric_user(user: str) -> bool:
    """Whether `user` is `uid[:gid]` in numbers (else names, resolved in the container: `RESOLVE_USER`)."""
    uid, _, gid = user.partition(":")
    return uid.isdigit() and (not gid or gid.isdigit())


def _tmpfs(disk_mb: int | None, owner: tuple[int, int] | None) -> str:
    options = ["rw", "exec", "nosuid", "nodev"]
    if disk_mb:
        options.append(f"size={disk_mb}m")
    options += [f"uid={owner[0]}", f"gid={owner[1]}", "mode=0755"] if owner else ["mode=1777"]
    return ",".join(options)


def container_spec(*, image: str, limits: Limits, agent: tuple[int, int], work: str, home: str,
                   lifetime_s: float, owner: str, name: str, model_socket: str | None,
                   forwarder: Path, ro_binds: list[str] | None = None, image_root: bool = False,
                   egress_socket: str | None = None, extra_hosts: list[str] | None = None,
                   network_of: str | None = None, root_agent: bool = False) -> dict[str, Any]:
    """The create body of one sandbox container (see the module docstring for why each part is there).
    `image_root` (Harbor tasks): the root is the image's own, writable, and the work folder keeps the image's
    files (no tmpfs over it); root in the container keeps CHOWN, DAC_OVERRIDE and FOWNER so the verifier can
    hand the work folder to the agent user and empty what the agent left. An unprivileged agent user never holds
    them; a root agent (`root_agent`, a Harbor task's default) holds `ROOT_AGENT_CAPS`."""
    tmpfs = {home: _tmpfs(limits.disk_mb, agent), "/tmp": _tmpfs(limits.disk_mb, None)}
    if not image_root:
        tmpfs[work] = _tmpfs(limits.disk_mb, agent)
    host: dict[str, Any] = {
        "NetworkMode": "none", "ReadonlyRootfs": not image_root, "Init": True, "AutoRemove": True,
        "Privileged": False, "CapDrop": ["ALL"], "SecurityOpt": ["no-new-privileges"], "IpcMode": "private",
        "Tmpfs": tmpfs, "Binds": [], "Ulimits": [],
    }
    if image_root:
        host["CapAdd"] = list(ROOT_AGENT_CAPS if root_agent else VERIFIER_CAPS)
    if extra_hosts:  # a multi-container task's service names, on the group's shared loopback (the Engine writes
        host["ExtraHosts"] = list(extra_hosts)  # /etc/hosts only for a container whose networking it manages)
    if network_of:  # a multi-container task's verifier: the agent's group's loopback (its sidecars), no other
        host["NetworkMode"] = f"container:{network_of}"
    if limits.disk_mb:
        host["ShmSize"] = limits.disk_mb << 20
    if limits.pids:
        host["PidsLimit"] = limits.pids
    if limits.memory_bytes:
        host["Memory"] = host["MemorySwap"] = limits.memory_bytes
    if limits.cpus:
        host["NanoCpus"] = int(limits.cpus * 1e9)
    for ulimit, value in (("nofile", limits.open_files), ("fsize", limits.file_size_bytes), ("cpu", limits.cpu_s)):
        if value:
            host["Ulimits"].append({"Name": ulimit, "Soft": value, "Hard": value})
    if model_socket is not None:
        host["Binds"] = [f"{Path(model_socket).parent}:{MOUNT_DIR}/model:ro", f"{forwarder}:{MOUNT_DIR}/forwarder.py:ro"]
    if egress_socket is not None:  # a phase's egress proxy (`egress.py`): the same forwarder, another port
        host["Binds"] += [f"{Path(egress_socket).parent}:{MOUNT_DIR}/egress:ro"]
        if model_socket is None:
            host["Binds"].append(f"{forwarder}:{MOUNT_DIR}/forwarder.py:ro")
    # host folders the run mounts read-only at the same path (an agent CLI's install; under the input roots,
    # checked at /start_rollout)
    host["Binds"] += [f"{path}:{path}:ro" for path in ro_binds or []]
    labels = {LABEL: "1", OWNER_LABEL: owner, LIFE_LABEL: WORKER_LIFE, WORKER_LABEL: worker_id(),
              DEADLINE_LABEL: str(int(time.time() + lifetime_s)), "rollout-buffer.name": name[:200]}
    # the main process reads the worker's attached stdin: when the worker's end closes (cleanup, or the worker
    # dies), or at the lifetime, it exits and the container goes (AutoRemove)
    # with `image_root` the main process is root's (only then does an exec as root keep the added capabilities)
    return {"Image": image, "Entrypoint": ["timeout", str(int(lifetime_s)), "cat"], "Cmd": [],
            "User": "0:0" if image_root else KEEPER_USER,
            "WorkingDir": work, "Env": [], "Labels": labels, "NetworkDisabled": not (extra_hosts or network_of), "OpenStdin": True,
            "StdinOnce": True, "AttachStdin": True, "AttachStdout": False, "AttachStderr": False, "Tty": False,
            "HostConfig": host}


def worker_id(pid: int | None = None) -> str:
    """`pid:start time` of a process of this host (the start time tells a reused pid apart); "" if gone."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return f"{pid}:{fields[19].decode()}" if len(fields) > 19 else ""


def worker_gone(label: str) -> bool:
    """Whether the worker named by a container's WORKER_LABEL no longer runs on this host."""
    pid = label.partition(":")[0]
    return pid.isdigit() and worker_id(int(pid)) != label


def container_name(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")[:48]
    return f"rb-{safe or 'sandbox'}-{uuid.uuid4().hex[:10]}"


async def image_exists(image: str, options: dict[str, Any] | None = None) -> bool:
    """Whether the Engine has `image` locally (nothing is pulled); SandboxError when it is unreachable."""
    docker = connect(options)
    try:
        await docker.images.inspect(image)
        return True
    except DockerError as exc:
        if exc.status == 404:
            return False
        raise engine_error(f"inspect image {image!r}", exc) from exc
    except ENGINE_ERRORS as exc:
        raise engine_error(f"inspect image {image!r}", exc) from exc
    finally:
        await docker.close()


async def remove_stale_containers(owner: str | None = None, options: dict[str, Any] | None = None) -> int:
    """Remove the sandbox containers a worker that is gone left (its `owner`, another life, and the worker
    process its WORKER_LABEL names no longer runs on this host), and any past its deadline; returns how many.
    Called at a worker's first docker rollout. A container of a live sibling worker (`serve` runs several
    worker processes on one host), created or running, is left alone. A container of an older version,
    without the label, goes only once it no longer runs."""
    owner = owner or DEFAULT_OWNER
    docker = connect(options)
    removed = 0
    try:
        found = await docker.containers.list(all=True, filters=json.dumps({"label": [f"{LABEL}=1"]}))
        present = {container.id for container in found}
        for container in found:
            labels = container._container.get("Labels") or {}
            deadline = labels.get(DEADLINE_LABEL, "")
            expired = deadline.isdigit() and int(deadline) < time.time()
            worker = labels.get(WORKER_LABEL)
            gone = worker_gone(worker) if worker else container._container.get("State") != "running"
            left = labels.get(OWNER_LABEL) == owner and labels.get(LIFE_LABEL) != WORKER_LIFE and gone
            # a multi-container task's sidecar outlives its sandbox only when a worker died between the two
            orphan = bool(labels.get(PARENT_LABEL)) and labels[PARENT_LABEL] not in present
            if expired or left or orphan:
                try:
                    await container.delete(force=True)
                    removed += 1
                except DockerError as exc:
                    if exc.status not in (404, 409):  # gone already, or its removal is under way
                        raise
    except ENGINE_ERRORS as exc:
        raise engine_error("remove stale sandbox containers", exc) from exc
    finally:
        await docker.close()
    return removed


async def remove_container(docker: Any, container: Any) -> None:
    """Force-remove and wait until the Engine no longer knows the container (its AutoRemove may race)."""
    with contextlib.suppress(DockerError):
        await container.delete(force=True)
    for _ in range(100):
        try:
            await docker.containers.get(container.id)
        except DockerError as exc:
            if exc.status == 404:
                return
            raise engine_error("remove the container", exc) from exc
        except ENGINE_ERRORS as exc:
            raise engine_error("remove the container", exc) from exc
        await asyncio.sleep(0.05)
    raise SandboxError(f"docker: container {container.id[:12]} is still there after its removal")


def check_image(options: dict[str, Any]) -> None:
    """At `/start_rollout` (in a thread): refuse a run whose image the Engine does not have, with a 4xx naming
    it (an unreachable Engine is refused too: nothing could run)."""
    host = options.get("docker_host")
    if host is not None and (not isinstance(host, str) or not host.startswith(("unix://", "/"))):
        raise SandboxError("options.docker_host must be a unix socket of this host (unix:///...); for an Engine "
                           "elsewhere, set DOCKER_HOST for the server")
    helper = options.get("forwarder_image")  # the image the forwarders run in (`docker_holder.py`), if the run names one
    if helper is not None and (not isinstance(helper, str) or not helper or not asyncio.run(image_exists(helper, options))):
        raise SandboxError(f"options.forwarder_image {helper!r} is not an image in the Docker Engine at "
                           f"{docker_url(options)} (images are never pulled: build or load one with python3)")
    image = options.get("image")
    if image is None:  # each line names its own (`image`, or a Harbor task's); a line without one fails alone
        return
    if not isinstance(image, str) or not image:
        raise SandboxError("the docker sandbox needs options.image (an image the Docker Engine has)")
    if not asyncio.run(image_exists(image, options)):
        raise SandboxError(f"image {image!r} is not in the Docker Engine at {docker_url(options)} (images "
                           "are never pulled: build or load it first)")


_swept: dict[str, asyncio.Lock] = {}
_swept_done: set[str] = set()


async def sweep_once(options: dict[str, Any]) -> None:
    """A worker's first docker sandbox on an Engine first removes what an earlier life of it left there."""
    url = docker_url(options)
    if url in _swept_done:
        return
    async with _swept.setdefault(url, asyncio.Lock()):
        if url not in _swept_done:
            await remove_stale_containers(str(options.get("owner") or DEFAULT_OWNER), options)
            _swept_done.add(url)
