"""The docker sandbox backend: a fresh container per rollout, built by `docker_engine.container_spec`.

`await DockerSandbox(name=, limits=, options=, model_socket=)` creates and starts the container (the object
is awaitable because making a container must await; `open_sandbox` awaits it). Options: `image` (required,
never pulled), `workdir` (default `/app`, Harbor's), `home` (default `/home/agent`), `user` (numeric
`uid[:gid]`, default `1000:1000`; with `image_root`, names too, and by default the task's `task_user`, else the
image's USER, else root, as Harbor's: `docker_procs` and `docker_watch` keep a root agent's doings its own),
`lifetime_s` (the container removes itself after it, default 6 h),
`owner` (see `remove_stale_containers`), `docker_host`, `ro_binds` (host folders mounted read-only at the
same path, e.g. an agent CLI's install), `image_root` (Harbor tasks: the image's writable root, its work
folder's files kept and handed to the agent user; `exec_root` runs the verifier as root).

The image needs `sh`, `env`, `cat`, `mkdir`, `timeout` (a Debian-like base), and `python3` for a model socket: the
forwarder (`forwarder.py`, mounted read-only at `/run/rollout-buffer`) serves `model_url` on the container's loopback.
With `forwarder_image` (an image with python3; `--forwarder-image` sets it for every docker sandbox) the image needs
no python3: the forwarders run in a holder container of that image (`docker_holder.py`), whose network namespace
(its loopback only) the container joins.

Commands run as the agent user under `env -i` (exactly the run's environment plus PATH, HOME, TMPDIR, LANG,
LC_ALL). Docker cannot kill an exec, so when a command ends or reaches its deadline every process of the
agent user in the container is killed (`kill -KILL -1` as that user: the container's pid namespace bounds
it, and the init, main process and forwarder run as another user), then verified gone with the Engine's
`top`; this mirrors the local backend, whose guard kills every descendant when the command exits. Files
move through `cat` in the container: the Engine's archive API refuses a container with a read-only root.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from aiodocker.containers import DockerContainer
from aiodocker.exceptions import DockerError
from aiodocker.execs import Exec

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents import docker_holder as holder
from rollout_buffer.agents import docker_storage as storage
from rollout_buffer.agents.docker_engine import image_exists, remove_stale_containers
from rollout_buffer.agents.docker_procs import KILL_BUDGET_S, AgentProcesses
from rollout_buffer.agents.docker_watch import KillWatch
from rollout_buffer.agents.docker_sidecars import remove_sidecars, service_hosts, start_sidecars
from rollout_buffer.agents.local import _Tail
from rollout_buffer.agents.sandbox import EGRESS_PORT, MODEL_PORT, ExecResult, Limits, SandboxError

__all__ = ["DockerSandbox", "image_exists", "remove_stale_containers"]  # the last two: for the integration

FORWARDER = Path(__file__).with_name("forwarder.py")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_READY = ("import socket, sys, time\nfor _ in range(200):\n    try:\n        socket.create_connection(('127.0.0.1', "
          f"{MODEL_PORT}), 1).close()\n        sys.exit(0)\n    except OSError:\n        time.sleep(0.05)\nsys.exit(3)")


class DockerSandbox(AgentProcesses):
    """One rollout's container (see the module docstring)."""

    isolated = True
    check_options = staticmethod(engine.check_image)
    model_peer_uid = engine.parse_user(engine.KEEPER_USER)[0]  # the forwarder's, the model socket's only user

    def __init__(self, *, name: str, limits: Limits, options: dict[str, Any] | None = None,
                 model_socket: str | None = None) -> None:
        self.options = dict(options or {})
        self.name, self.limits, self.model_socket = name, limits, model_socket
        self.image = self.options.get("image")
        if not isinstance(self.image, str) or not self.image:
            raise SandboxError("the docker sandbox needs options.image (an image the Docker Engine has)")
        self.image_root = bool(self.options.get("image_root"))
        self.hand_over = self.image_root and bool(self.options.get("hand_over", True))  # an agent's, not a verifier's
        # a Harbor task's agent (its image's own root) runs as the run's `user`, else the task's `[agent] user`,
        # else the image's USER, else root, as Harbor's does; a name is resolved in the container (`_own_user`)
        self.user = str(self.options.get("user") or self.options.get("task_user") or "") if self.image_root \
            else str(self.options.get("user") or "1000:1000")
        self.uid, self.gid = engine.parse_user(self.user, allow_root=True) if engine.numeric_user(self.user) else (0, 0)
        if not self.image_root:
            engine.parse_user(self.user)
        self.work = posixpath.normpath(str(self.options.get("workdir") or "/app"))
        self.home = posixpath.normpath(str(self.options.get("home") or "/home/agent"))
        for place in (self.work, self.home):
            if not place.startswith("/") or place == "/":
                raise SandboxError(f"docker sandbox folders must be absolute and not '/', got {place!r}")
        self.lifetime_s = float(self.options.get("lifetime_s") or 6 * 3600)
        self.model_url: str | None = None
        # a phase's egress proxy socket (`egress.py`): served at `egress_url`, for HTTP(S)_PROXY
        self.egress_socket: str | None = self.options.get("egress_socket")
        self.egress_url: str | None = None
        self.forwarder_image = self.options.get("forwarder_image") or None
        if self.forwarder_image is not None and not isinstance(self.forwarder_image, str):
            raise SandboxError("the docker sandbox option forwarder_image must be an image name")
        self._holder: DockerContainer | None = None  # the forwarders' container, whose network this one joins
        # a multi-container task's services, (Sidecar, image) in start order (`docker_sidecars.py`)
        self.sidecars: list[Any] = list(self.options.get("sidecars") or [])
        self._sidecar_containers: list[DockerContainer] = []
        self.container_id: str | None = None
        self._path_env = DEFAULT_PATH
        self.storage_watched = False  # the writable root's disk_mb held by watching it (no Engine quota)
        self._docker = None
        self._container: DockerContainer | None = None
        self._closed = False
        self._stopped = self._stopped_verified = self.vanished = False  # vanished: removed by another's hand
        self._lock = asyncio.Lock()
        self._tether = contextlib.AsyncExitStack()
        self._watch: KillWatch | None = None  # who ends the container: the Engine's API or something inside
        self.died_inside = False  # the container died of what ran in it (the agent's doing), not by the Engine

    def __await__(self) -> Generator[Any, None, DockerSandbox]:
        """`await DockerSandbox(...)` creates and starts the container (what `open_sandbox` does)."""
        return self._start().__await__()

    async def _start(self) -> DockerSandbox:
        if self._docker is not None:  # awaited again: the same sandbox, not a second container
            return self
        await engine.sweep_once(self.options)
        self._docker = engine.connect(self.options)
        try:
            if self.forwarder_image and (self.model_socket or self.egress_socket):
                self._holder = await holder.sandbox_holder(self._docker, self)
            await self._create()
            if self.sidecars:
                await start_sidecars(self._docker, self._live(), self.sidecars, self.name, self._sidecar_containers,
                                     network=self.network_id)
            if self.model_socket is not None and self._holder is None:
                await self._start_forwarder()
            if self.egress_socket is not None and self._holder is None:
                await self._start_forwarder(self.egress_socket, "egress", EGRESS_PORT)
            if self.hand_over and self.uid == 0:  # a root agent: the container's own processes, before it runs
                await self.record_keepers()
        except BaseException:
            await asyncio.shield(self.cleanup())
            raise
        return self

    @property
    def network_id(self) -> str | None:
        """The container whose network namespace this sandbox's containers share: the holder's, else its own."""
        return self._holder.id if self._holder is not None else self.container_id

    async def _create(self) -> None:
        assert self._docker is not None
        held = self._holder is not None  # then the holder serves the sockets and holds the names and network
        spec = engine.container_spec(
            image=self.image, limits=self.limits, agent=(self.uid, self.gid), work=self.work, home=self.home,
            lifetime_s=self.lifetime_s, owner=str(self.options.get("owner") or engine.DEFAULT_OWNER), name=self.name,
            model_socket=None if held else self.model_socket, forwarder=FORWARDER,
            ro_binds=[str(Path(p).resolve()) for p in self.options.get("ro_binds") or []],
            image_root=self.image_root, egress_socket=None if held else self.egress_socket, root_agent=self.hand_over,
            extra_hosts=[] if held else service_hosts([s for s, _ in self.sidecars]),
            network_of=self.network_id if held else self.options.get("network_of"))
        try:
            image = await self._docker.images.inspect(self.image)
        except DockerError as exc:
            if exc.status == 404:
                raise SandboxError(f"docker: image {self.image!r} is not in the Docker Engine (images are never "
                                   f"pulled: build or load it first)") from exc
            raise engine.engine_error(f"inspect image {self.image!r}", exc) from exc
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error(f"inspect image {self.image!r}", exc) from exc
        for item in (image.get("Config") or {}).get("Env") or []:
            if item.startswith("PATH="):
                self._path_env = item[5:]
        if self.image_root and not self.user:
            self.user = str((image.get("Config") or {}).get("User") or "0:0")  # the image's USER, else root
        try:
            container = await self._create_container(spec)
            self._container, self.container_id = container, container.id
            # the tether: the main process's stdin; it closes with this client, or with the worker's death
            await self._tether.enter_async_context(container.attach(stdin=True, stdout=False, stderr=False))
            await container.start()
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error(f"create a container of {self.image!r}", exc) from exc
        self._watch = KillWatch(self._docker, container.id)
        await self._watch.start()
        if self.hand_over:
            await self._own_user()

    async def _own_user(self) -> None:
        """A Harbor task's agent user, resolved in its container (a name through the image's passwd and group
        files); an unprivileged one is handed the work folder, with the image's files in it, and its home."""
        if not engine.numeric_user(self.user):
            code, out, err = await self._run(["sh", "-c", engine.RESOLVE_USER, "sh", self.user], user="0:0")
            if code != 0 or not engine.numeric_user(out.decode().strip()):
                raise SandboxError(f"docker: the agent user {self.user!r} is not in the image {self.image!r} "
                                   f"({err[-300:] or out.decode()[-300:]!r})")
            self.user = out.decode().strip()
        self.uid, self.gid = engine.parse_user(self.user, allow_root=True)
        self.user = f"{self.uid}:{self.gid}"
        if self.uid == 0:
            return
        code, _, err = await self._run(["sh", "-c", 'mkdir -p -- "$1" && chown -R "$2" -- "$1" && chown "$2" -- "$3"',
                                        "sh", self.work, self.user, self.home], user="0:0")
        if code != 0:
            raise SandboxError(f"docker: cannot hand {self.work} to the agent user (exit {code}: {err[-300:]!r})")

    async def _create_container(self, spec: dict[str, Any]) -> DockerContainer:
        """Create the container; a writable root gets a disk bound (`docker_storage.create`)."""
        assert self._docker is not None
        name = engine.container_name(self.name)
        if not (self.options.get("image_root") and self.limits.disk_mb):
            return await self._docker.containers.create(spec, name=name)
        container, self.storage_watched = await storage.create(self._docker, spec, name, self.limits.disk_mb,
                                                               engine.docker_url(self.options))
        return container

    async def exec_root(self, argv: list[str], *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A command as root in the container, never the agent's (Harbor's verifier: it empties /tests and
        /logs/verifier, uploads the tests, runs them, reads the reward). `timeout` bounds it inside, and the
        call gives up `KILL_BUDGET_S` later whatever happens there."""
        started = time.monotonic()
        wrapped = ["timeout", "-k", "5", str(max(1, int(timeout_s))), *argv]
        try:
            code, out, err = await asyncio.wait_for(
                self._run(wrapped, user="0:0", stdin=stdin, limit=self.limits.output_bytes), timeout_s + KILL_BUDGET_S)
        except TimeoutError:
            code, out, err = 137, b"", "the command did not end at its deadline"
        return ExecResult(exit_code=code, stdout=out.decode(errors="replace"), stderr=err, timed_out=code in (124, 137),
                          duration_s=round(time.monotonic() - started, 3))

    async def _start_forwarder(self, socket_path: str | None = None, folder: str = "model",
                               port: int = MODEL_PORT) -> None:
        """Serve a mounted socket (the model's, or a phase's egress proxy) on the container's loopback."""
        socket_path = socket_path or self.model_socket
        assert socket_path is not None
        sock = f"{engine.MOUNT_DIR}/{folder}/{Path(socket_path).name}"
        code, _, err = await self._run(["python3", "-c", "pass"], user=engine.KEEPER_USER)
        if code != 0:
            raise SandboxError(f"docker: image {self.image!r} has no working python3, which the {folder} forwarder "
                               f"needs (exit {code}: {err[-300:]!r}): add it, or set the sandbox option "
                               "forwarder_image / --forwarder-image to an image with python3")
        try:
            forward = await self._exec_create(["python3", f"{engine.MOUNT_DIR}/forwarder.py", str(port), sock],
                                              user=engine.KEEPER_USER)
            await forward.start(detach=True)
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error(f"start the {folder} forwarder", exc) from exc
        code, _, err = await self._run(["python3", "-c", _READY.replace(str(MODEL_PORT), str(port))],
                                       user=engine.KEEPER_USER)
        if code != 0:
            raise SandboxError(f"docker: the {folder} forwarder did not listen on 127.0.0.1:{port} ({err[-300:]!r})")
        setattr(self, f"{folder}_url", f"http://127.0.0.1:{port}")  # model_url, egress_url

    def _path(self, path: str) -> str:
        base, rest = (self.home, path[2:]) if path.startswith("~/") else (self.work, path)
        target = posixpath.normpath(posixpath.join(base, rest))
        if not any(target == place or target.startswith(place + "/") for place in (self.work, self.home)):
            raise SandboxError(f"path {path!r} leaves the sandbox")
        return target

    def base_env(self) -> dict[str, str]:
        return {"PATH": self._path_env, "HOME": self.home, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}

    def _live(self) -> DockerContainer:
        if self._container is None or self._closed:
            raise SandboxError("docker: the sandbox is closed")
        if self._stopped:
            raise SandboxError("docker: the sandbox's container was stopped (its agent's processes could be "
                               "killed no other way)")
        return self._container

    async def _exec_create(self, argv: list[str], *, user: str, workdir: str | None = None,
                           stdin: bool = False) -> Exec:
        return await self._live().exec(argv, user=user, workdir=workdir or self.work, stdin=stdin,
                                       stdout=True, stderr=True)

    async def _exit_code(self, run: Exec) -> int:
        """The exec's exit code (the Engine may report it a moment after the output ends)."""
        for _ in range(100):
            info = await run.inspect()
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            await asyncio.sleep(0.02)
        return -1

    async def _run(self, argv: list[str], *, user: str | None = None, stdin: bytes | None = None,
                   limit: int | None = None) -> tuple[int, bytes, str]:
        """A short helper command: (exit code, stdout, stderr tail); Engine failures raise SandboxError."""
        out, err = _Tail(limit or 1 << 62), _Tail(1 << 16)
        try:
            run = await self._exec_create(argv, user=user or self.user, stdin=stdin is not None)
            async with run.start(detach=False) as stream:
                if stdin is not None:
                    await stream.write_in(stdin)
                    await stream.close()  # the command sees the end of its input; its exit code tells the rest
                else:
                    await _pump(stream, out, err)
            return await self._exit_code(run), bytes(out.data), err.text()
        except engine.ENGINE_ERRORS as exc:
            raise engine.engine_error(f"run {argv[0]!r} in the container", exc) from exc

    async def write_file(self, path: str, data: str | bytes) -> None:
        target = self._path(path)
        async with self._lock:
            code, _, _ = await self._run(["sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", target],
                                         stdin=data.encode() if isinstance(data, str) else data)
        if code != 0:
            raise SandboxError(f"docker: cannot write {path!r} in the sandbox (exit {code})")

    async def read_file(self, path: str) -> bytes:
        target = self._path(path)
        async with self._lock:
            code, data, err = await self._run(["cat", "--", target])
        if code != 0:
            if "No such file" in err:
                raise FileNotFoundError(f"{path!r} is not in the sandbox")
            raise SandboxError(f"docker: cannot read {path!r} in the sandbox (exit {code}: {err[-300:]!r})")
        return data

    async def exec(self, argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                   cwd: str | None = None) -> ExecResult:
        """One command at a time (its end kills every process of the agent user, so two would kill each other)."""
        workdir = self._path(cwd) if cwd else self.work
        async with self._lock:
            return await self._exec(argv, timeout_s, {**self.base_env(), **(env or {})}, workdir)

    async def _exec(self, argv: list[str], timeout_s: float, env: dict[str, str], workdir: str) -> ExecResult:
        out, err = _Tail(self.limits.output_bytes), _Tail(self.limits.output_bytes)
        started = time.monotonic()
        extra: dict[str, Any] = {}
        try:
            run = await self._exec_create(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
                                          user=self.user, workdir=workdir)
            async with run.start(detach=False) as stream:
                pump = asyncio.ensure_future(_pump(stream, out, err))
                try:
                    size = self._writable_bytes if self.storage_watched else None
                    stopped_by = await storage.watch(pump, timeout_s, size, self.limits.disk_mb)
                finally:
                    pump.cancel()
                if stopped_by:
                    extra["killed"] = await self.kill_agent_processes()
                if stopped_by == "disk_mb":
                    extra["stopped_by"] = stopped_by
            code = 137 if extra else await self._exit_code(run)
        except engine.ENGINE_ERRORS as exc:
            await self._check_gone(10)
            if not self.died_inside:
                await self._sweep()
                raise engine.engine_error(f"run {argv[:1]!r} in the container", exc) from exc
            code = 137
        except BaseException:  # cancelled: the command dies with the call
            await self._sweep()
            raise
        if not extra:  # did the container go away under the command? (a root agent can end it exiting 0)
            await self._check_gone(10 if code != 0 else 1)  # nothing of it runs then: no sweep to wait for
        if not extra and not self._stopped and not await self._sweep():  # what the command left behind dies
            await self._check_gone(1)  # with it, as on the local backend; or the container died meanwhile
        if self._stopped:
            extra["container_stopped"] = True
        if self.vanished:
            extra["container_vanished"] = True
        if self.died_inside:
            extra["container_died_inside"] = True
        note = f"\n[sandbox: stopped, its writable root passed disk_mb={self.limits.disk_mb}]" \
            if extra.get("stopped_by") == "disk_mb" else ""
        return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text() + note,
                          timed_out="killed" in extra and "stopped_by" not in extra,
                          duration_s=round(time.monotonic() - started, 3), output_bytes=out.total + err.total,
                          truncated=out.total > len(out.data) or err.total > len(err.data), extra=extra)

    async def _writable_bytes(self) -> int:
        return await storage.writable_bytes(self._live())

    async def _sweep(self) -> bool:
        with contextlib.suppress(Exception):
            return await asyncio.shield(self.kill_agent_processes())
        return False

    async def cleanup(self) -> None:
        """Remove the container (force: its processes die with it) and close the client; safe twice."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._teardown())  # a cancelled rollout still removes its container

    async def _teardown(self) -> None:
        try:
            if self._watch is not None:
                await self._watch.close()
            with contextlib.suppress(Exception):
                await self._tether.aclose()
            if self._docker is not None:
                await remove_sidecars(self._docker, self._sidecar_containers)
            if self._container is not None and self._docker is not None:
                await engine.remove_container(self._docker, self._container)
        finally:
            if self._holder is not None and self._docker is not None:  # after what joined its network
                await holder.remove_holder(self._docker, self._holder)
            if self._docker is not None:
                await self._docker.close()


async def _pump(stream: Any, out: _Tail, err: _Tail) -> None:
    while (message := await stream.read_out()) is not None:
        (err if message.stream == 2 else out).add(message.data)
