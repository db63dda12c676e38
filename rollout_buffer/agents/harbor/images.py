"""A Harbor task's image: its `docker_image` (pulled when the Engine lacks it), or built from its `environment/`.

A built image is tagged `rollout-buffer-harbor/<task>:<hash of environment/>`, so it is built once per task
and content and found in the Engine's cache after that, by every worker and every later run. The build runs
through the Engine's API with no network (`networkmode: none`, nothing pulled: a `FROM` names an image the
Engine has), or, when the operator grants builds hosts (`--egress-build`), with an egress proxy to those hosts
only (`build_net`), under the task's `build_timeout_sec`. A named `docker_image` the Engine lacks is pulled from its
registry (credentials from the Docker client's config, `registry_auth`; a digest-pinned reference is pulled
by its digest), unless the run's sandbox options say `pull: "never"`; `force_build: true` builds from
`environment/Dockerfile` instead, as Harbor's `--force-build` does.

A pull or a build happens once per image per Engine, whatever the number of worker processes: every process
holds this process's lock, then the host lock the runtime hands over (`HostLock`: a lock in Redis keyed by the
Engine's ID and the image), and looks again before it pulls or builds. A failed pull or build raises
`BuildFailed`, a `SandboxError`: the rollout is a counted infrastructure failure naming the image, never a
reward. A failure is remembered for `FAILED_TTL_S`, so a task's repeats do not rebuild or re-pull each.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents.harbor import image_cache
from rollout_buffer.agents.harbor.build_net import BuildEgress, HolderFailed, build_network
from rollout_buffer.tasks.harbor_compose import Sidecar
from rollout_buffer.agents.sandbox import SandboxError
from rollout_buffer.tasks import host_events
from rollout_buffer.tasks.contract import HostLock, ImageCache
from rollout_buffer.tasks.harbor import environment_hash

REPOSITORY = "rollout-buffer-harbor"
DEFAULT_WORKDIR = "/app"
FAILED_TTL_S = 300.0
PULL_TIMEOUT_S = 1800.0
_locks: dict[str, asyncio.Lock] = {}
_failed: dict[str, tuple[float, str]] = {}
_engine_ids: dict[str, str] = {}


class BuildFailed(SandboxError):
    """The task's image could not be built or pulled (the task's, the registry's or the Engine's, not the agent's)."""


def image_tag(harbor: dict[str, Any], env_hash: str | None = None) -> str:
    """The tag of a task's built image (its name made a valid repository path, and its content hash)."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", str(harbor["name"]).lower()).strip("-._")[:80] or "task"
    return f"{REPOSITORY}/{safe}:{env_hash or harbor['env_hash']}"


def folder_tar(env_dir: Path) -> bytes:
    """A folder as a tar (links kept as links, nothing outside it followed): a build context, an upload."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(env_dir.rglob("*")):
            tar.add(path, arcname=path.relative_to(env_dir).as_posix(), recursive=False)
    return buffer.getvalue()


def registry_host(reference: str) -> str:
    """The registry a reference names (Docker's rule: the first path part, when it has a '.' or ':' or is
    `localhost`), else Docker Hub's."""
    first, slash, _ = reference.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def registry_auth(reference: str, config_path: Path | None = None) -> dict[str, str] | None:
    """The credentials the Docker client's config (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`)
    holds for the reference's registry, as the Engine's pull takes them; None when it holds none."""
    path = config_path or Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"
    try:
        auths = json.loads(path.read_text()).get("auths") or {}
    except (OSError, ValueError, AttributeError):
        return None
    host = registry_host(reference)
    wanted = {host, f"https://{host}", f"http://{host}"}
    if host == "docker.io":
        wanted.add("https://index.docker.io/v1/")
    for name, entry in auths.items():
        if name.rstrip("/") in wanted or name in wanted:
            token = (entry or {}).get("auth")
            if isinstance(token, str) and token:
                user, _, password = base64.b64decode(token).decode(errors="replace").partition(":")
                return {"username": user, "password": password, "serveraddress": host}
    return None


async def _inspect(docker: Any, image: str) -> dict[str, Any] | None:
    try:
        return await docker.images.inspect(image)
    except engine.DockerError as exc:
        if exc.status == 404:
            return None
        raise engine.engine_error(f"inspect image {image!r}", exc) from exc
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error(f"inspect image {image!r}", exc) from exc


async def engine_id(docker: Any, options: dict[str, Any]) -> str:
    """The Engine's own ID (`/info`): one Engine's lock name whichever URL or host reaches it."""
    url = engine.docker_url(options)
    if url not in _engine_ids:
        try:
            info = await docker.system.info()
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error("read the Engine's info", exc) from exc
        _engine_ids[url] = str(info.get("ID") or url)
    return _engine_ids[url]


@dataclass(frozen=True)
class Recipe:
    """How to make an image the Engine lacks: pulled (`context` None) or built from a folder's Dockerfile."""

    what: str  # whose image, for messages: "harbor task 'x'", "harbor task 'x' service 'db'"
    context: Path | None = None
    dockerfile: str = "Dockerfile"
    timeout_s: float = PULL_TIMEOUT_S
    task: str = ""
    egress: BuildEgress | None = None  # the hosts a build may reach (`--egress-build`); None: no network


async def _build(docker: Any, recipe: Recipe, tag: str, options: dict[str, Any]) -> None:
    assert recipe.context is not None
    params = {"t": tag, "rm": "1", "forcerm": "1", "pull": "0", "dockerfile": recipe.dockerfile,
              "labels": json.dumps({"rollout-buffer.harbor": "1", "rollout-buffer.task": recipe.task[:200]})}
    data = await asyncio.to_thread(folder_tar, recipe.context)
    owner = str(options.get("owner") or engine.DEFAULT_OWNER)
    try:
        async with build_network(docker, recipe.context / recipe.dockerfile, recipe.egress, owner=owner,
                                 timeout_s=recipe.timeout_s, what=recipe.task or recipe.context.name,
                                 forwarder_image=options.get("forwarder_image")) as network:
            try:
                await _stream_build(docker, recipe, {**params, **network.params}, data)
            except BuildFailed as exc:  # the hosts the build was refused, if any
                raise BuildFailed(f"{exc}{network.refusals()}") from exc
    except HolderFailed as exc:
        raise BuildFailed(f"{recipe.what}: {exc}") from exc


async def _stream_build(docker: Any, recipe: Recipe, params: dict[str, str], data: bytes) -> None:
    assert recipe.context is not None
    log: list[str] = []
    timeout = aiohttp.ClientTimeout(total=recipe.timeout_s)
    async with docker._query("build", "POST", params=params, headers={"content-type": "application/x-tar"},
                             data=data, timeout=timeout) as response:
        async for raw in response.content:
            try:
                item = json.loads(raw)
            except ValueError:
                continue
            if item.get("error"):
                raise BuildFailed(f"{recipe.what}: {recipe.context.name}/ build failed: "
                                  f"{str(item['error'])[-500:]} (last output: {''.join(log)[-800:]!r})")
            if isinstance(item.get("stream"), str):
                log.append(item["stream"])


async def _pull(docker: Any, recipe: Recipe, image: str) -> None:
    try:
        await asyncio.wait_for(docker.images.pull(image, auth=registry_auth(image)), PULL_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError) as exc:
        raise BuildFailed(f"{recipe.what}: pulling image {image!r} ran past {PULL_TIMEOUT_S:g} s") from exc
    except (engine.DockerError, ValueError) as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise BuildFailed(f"{recipe.what}: cannot pull image {image!r}: {message}") from exc
    except engine.ENGINE_ERRORS as exc:
        raise engine.engine_error(f"pull image {image!r}", exc) from exc


@contextlib.asynccontextmanager
async def _held(lock: HostLock | None, name: str, hold_s: float) -> AsyncIterator[None]:
    if lock is None:
        yield
        return
    try:
        async with lock(name, hold_s):
            yield
    except TimeoutError as exc:
        raise SandboxError(f"docker: another worker has held the lock on {name!r} for over {hold_s:g} s") from exc


async def _make(docker: Any, recipe: Recipe, image: str, *, options: dict[str, Any],
                lock: HostLock | None, cache: ImageCache | None = None) -> dict[str, Any]:
    """Pull or build `image` once: this process's lock, then the host's, then a second look; a bounded cache
    is trimmed after (`image_cache.trim`)."""
    build = recipe.context is not None
    async with _locks.setdefault(image, asyncio.Lock()):
        found = await _inspect(docker, image)
        if found is not None:
            return found
        async with _held(lock, f"image:{await engine_id(docker, options)}:{image}", recipe.timeout_s + 60.0):
            found = await _inspect(docker, image)
            if found is not None:
                return found
            try:
                await (_build(docker, recipe, image, options) if build else _pull(docker, recipe, image))
            except BuildFailed as exc:
                _failed[image] = (time.monotonic(), str(exc))
                raise
            except (TimeoutError, asyncio.TimeoutError) as exc:
                message = f"{recipe.what}: the image build ran past its build_timeout_sec {recipe.timeout_s:g}"
                _failed[image] = (time.monotonic(), message)
                raise BuildFailed(message) from exc
            except engine.ENGINE_ERRORS as exc:
                raise engine.engine_error(f"build the image of {recipe.what}", exc) from exc
            host_events.note("image_builds" if build else "image_pulls")  # this host's, on /metrics
            found = await _inspect(docker, image)
            if found is not None and cache is not None:
                engine_key = await engine_id(docker, options)
                await cache.used(engine_key, image)
                await image_cache.trim(docker, cache, engine_key, keep=image)
    if found is None:
        raise BuildFailed(f"{recipe.what}: the {'build' if build else 'pull'} ended without image {image!r}")
    return found


async def ensure_image(image: str, recipe: Recipe, options: dict[str, Any], lock: HostLock | None = None,
                       cache: ImageCache | None = None) -> dict:
    """The Engine's record of `image`, pulled or built first when it lacks it (once per Engine under `lock`);
    with a `cache`, its use is recorded when the buffer made it, and the cache trimmed after a pull or build."""
    failed = _failed.get(image)
    if failed and time.monotonic() - failed[0] < FAILED_TTL_S:
        raise BuildFailed(failed[1])
    docker = engine.connect(options)
    try:
        found = await _inspect(docker, image)
        if found is None and recipe.context is None and options.get("pull") == "never":
            raise SandboxError(f"{recipe.what}: image {image!r} is not in the Docker Engine, and the run's sandbox "
                               "options say pull: never")
        if found is None:
            found = await _make(docker, recipe, image, options=options, lock=lock, cache=cache)
        elif cache is not None:  # a use of an image the buffer made (one it did not make is not recorded)
            await cache.used(await engine_id(docker, options), image, add=False)
        return found
    finally:
        await docker.close()


def _source(harbor: dict[str, Any], options: dict[str, Any]) -> tuple[str, bool]:
    """(the image to run, whether it is built here): `force_build` builds from environment/Dockerfile."""
    dockerfile = Path(harbor["dir"]) / "environment" / "Dockerfile"
    if harbor.get("docker_image") and not options.get("force_build"):
        return str(harbor["docker_image"]), False
    if not dockerfile.is_file():
        raise BuildFailed(f"harbor task {harbor['name']!r}: force_build asks for a build, and there is no "
                          "environment/Dockerfile")
    env_hash = harbor.get("env_hash") or environment_hash(dockerfile.parent, str(harbor["name"]))
    return image_tag(harbor, env_hash), True


async def task_image(harbor: dict[str, Any], options: dict[str, Any], lock: HostLock | None = None,
                     cache: ImageCache | None = None, egress: BuildEgress | None = None) -> tuple[str, str]:
    """(image, its working folder) for a task: the named image (pulled when the Engine lacks it), or the built
    one (built now when the Engine lacks it, reaching `egress`'s hosts only). BuildFailed / SandboxError when
    there is none to run."""
    image, build = _source(harbor, options)
    what = f"harbor task {harbor['name']!r}"
    recipe = (Recipe(what, Path(harbor["dir"]) / "environment", timeout_s=float(harbor["build_timeout_sec"]),
                     task=str(harbor["name"]), egress=egress) if build else Recipe(what))
    found = await ensure_image(image, recipe, options, lock, cache)
    workdir = (found.get("Config") or {}).get("WorkingDir") or DEFAULT_WORKDIR
    return image, workdir


async def image_user(image: str, options: dict[str, Any]) -> str:
    """The image's own USER ("" when it sets none: root), from the Engine's record of it."""
    docker = engine.connect(options)
    try:
        found = await _inspect(docker, image)
    finally:
        await docker.close()
    return str(((found or {}).get("Config") or {}).get("User") or "")


async def service_image(harbor: dict[str, Any], sidecar: Sidecar, options: dict[str, Any],
                        lock: HostLock | None = None, cache: ImageCache | None = None,
                        egress: BuildEgress | None = None) -> str:
    """A multi-container task's service image: its `image` (pulled when missing) or built from its context."""
    what = f"harbor task {harbor['name']!r} service {sidecar.name!r}"
    if sidecar.build_context is None:
        assert sidecar.image is not None
        await ensure_image(sidecar.image, Recipe(what), options, lock, cache)
        return sidecar.image
    context = Path(sidecar.build_context)
    digest = environment_hash(context, str(harbor["name"]))
    tag = image_tag({"name": f"{harbor['name']}-{sidecar.name}"}, f"{digest[:32]}")
    await ensure_image(tag, Recipe(what, context, sidecar.dockerfile, float(harbor["build_timeout_sec"]),
                                   str(harbor["name"]), egress), options, lock, cache)
    return tag
