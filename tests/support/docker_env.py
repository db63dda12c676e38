"""A running Docker Engine and a small Debian base image for the docker sandbox tests, once per session.

The Engine: `DOCKER_HOST` or `/var/run/docker.sock` when it answers `/_ping`; otherwise one `dockerd` per
suite run, shared by its xdist workers (the first that needs it starts it, as root, on a socket of the suite
run's folder; the controller stops it at the end), with no bridge, no iptables and no masquerading (every
sandbox container has network none). Its data root is cached per checkout, so the image survives between
runs and two checkouts' suites never share one; a second suite of the same checkout at once (the root's
lock is held by the first one's dockerd) gets a fresh root of its own.
The image: no registry is reachable, so the rootfs is built from Debian packages with `mmdebstrap`
(python3 for the model forwarder, bash and procps for the scripts), cached as a tarball under
`~/.cache/rollout-buffer/` and imported through the Engine's API as `rollout-buffer-test-base:<hash>`.
A missing dockerd or mmdebstrap fails the tests with what to install: they are never skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json as _json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
INCLUDE = ("python3", "ca-certificates", "bash", "procps", "nodejs")  # nodejs: Claude Code runs in it
CACHE = Path(os.environ.get("ROLLOUT_BUFFER_TEST_CACHE") or Path.home() / ".cache" / "rollout-buffer")
IMAGE_REPO = "rollout-buffer-test-base"
BUILD_TIMEOUT_S = 480  # the first build only (about a minute on an idle machine); the test module allows for it
INSTALL_HINT = "install Debian's docker.io and mmdebstrap (.ci/run does), and run the tests as root"


@dataclass(frozen=True)
class DockerEnv:
    url: str  # unix:///... of the Engine
    image: str  # the base image's name:tag

    def image_without_python(self) -> str:
        """The base image less python3 (imported on first use)."""
        return ensure_image(self.url, without_python=True)

    def options(self, **extra: Any) -> dict[str, Any]:
        """A run's `sandbox.options` for this Engine and image."""
        return {"image": self.image, "docker_host": self.url, **extra}


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _request(url: str, method: str, target: str, body: Any = None, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = _UnixHTTP(url.removeprefix("unix://"), timeout)
    try:
        conn.request(method, target, body=body, headers={"Content-Type": "application/x-tar"} if body else {})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def answers(url: str) -> bool:
    """Whether an Engine answers on this unix socket URL."""
    if not url.startswith("unix://"):
        return False
    try:
        return _request(url, "GET", "/_ping", timeout=3.0) == (200, b"OK")
    except OSError:
        return False


def _wait(check: Any, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    pytest.fail(f"{what} within {timeout_s:.0f}s\n{tail}")


SUITE_ENV = "RB_SUITE_ID"  # set once per suite run by the controller (tests/conftest.py); its workers inherit it
_STARTED: list[subprocess.Popen[bytes]] = []  # this process's dockerd, if it started the suite's (kept, not reaped)


def suite_dir() -> Path:
    """This suite run's folder for its shared dockerd (socket, pidfile, log): one per `python -m pytest`,
    shared by its xdist workers. Short: containerd's socket paths are bounded."""
    suite = os.environ.get(SUITE_ENV) or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"rbd-{suite[:12]}"


def data_root_lock(run_dir: Path) -> tuple[Path, Any]:
    """The dockerd data root to use and the open lock file that claims it: this checkout's cached root (per
    checkout, so suites of two checkouts by one account never share one), or a fresh one in `run_dir` when
    another suite of this checkout holds it. The lock is inherited by dockerd, so it is held while dockerd runs."""
    CACHE.mkdir(parents=True, exist_ok=True)
    checkout = hashlib.sha256(str(Path(__file__).resolve().parents[2]).encode()).hexdigest()[:10]
    lock = open(CACHE / f"dockerd-{checkout}.lock", "w")  # noqa: SIM115 - handed to dockerd, closed here after
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return CACHE / f"dockerd-data-{checkout}", lock
    except OSError:
        return run_dir / "data", lock


@contextlib.contextmanager
def _own_dockerd() -> Iterator[str]:
    """The suite run's own dockerd: the first worker that needs it starts it (under a lock), the others use it;
    the controller stops it when the suite ends (`stop_suite_dockerd`)."""
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None)
    if dockerd is None or os.geteuid() != 0:
        pytest.fail(f"no Docker Engine answers (DOCKER_HOST, /var/run/docker.sock) and none can be started "
                    f"(dockerd {'found' if dockerd else 'missing'}, uid {os.geteuid()}): {INSTALL_HINT}")
    run_dir = suite_dir()
    run_dir.mkdir(exist_ok=True)
    url, log = f"unix://{run_dir}/docker.sock", run_dir / "dockerd.log"
    with open(run_dir / "start.lock", "w") as starting:  # one starter per suite run; the others wait here
        fcntl.flock(starting, fcntl.LOCK_EX)
        if not answers(url):
            data_root, claim = data_root_lock(run_dir)
            with open(log, "ab") as out, claim:
                proc = subprocess.Popen(
                    [dockerd, "--host", url, "--data-root", str(data_root), "--exec-root", str(run_dir / "exec"),
                     "--pidfile", str(run_dir / "dockerd.pid"), "--iptables=false", "--ip-masq=false",
                     "--bridge=none"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    pass_fds=(claim.fileno(),))
            _wait(lambda: proc.poll() is not None or answers(url), 60, "dockerd did not answer", log)
            if proc.poll() is not None:
                pytest.fail(f"dockerd exited {proc.returncode}\n{log.read_text(errors='replace')[-3000:]}")
            (run_dir / "dockerd.started").write_text(str(proc.pid))
            _STARTED.append(proc)
    yield url


def suite_dockerd_pid() -> int | None:
    """The dockerd this suite run started (by any of its processes), while it runs."""
    started = suite_dir() / "dockerd.started"
    try:
        return int(started.read_text())
    except (OSError, ValueError):
        return None


def stop_suite_dockerd(timeout_s: float = 30.0) -> bool:
    """Stop the dockerd this suite run started, if any, and remove its folder; whether one was stopped. Called
    once, by the controller, after every worker is done."""
    run_dir = suite_dir()
    started = run_dir / "dockerd.started"
    if not started.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        return False
    pid = int(started.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.pid == pid and p.poll() is not None for p in _STARTED):  # our own child (no workers): reaped
                break
            os.kill(pid, 0)  # ProcessLookupError once it is gone (a worker's child, reaped by init)
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def image_tag(suite: str = SUITE, include: tuple[str, ...] = INCLUDE) -> str:
    return hashlib.sha256(f"{suite} {','.join(include)}".encode()).hexdigest()[:12]


def base_tarball(suite: str = SUITE, include: tuple[str, ...] = INCLUDE) -> Path:
    """The cached rootfs tarball (of `suite` with `include`: the base image's by default), built with mmdebstrap
    the first time (about a minute)."""
    tarball = CACHE / f"{IMAGE_REPO}-{image_tag(suite, include)}.tar"
    if tarball.exists():
        return tarball
    if shutil.which("mmdebstrap") is None:
        pytest.fail(f"mmdebstrap is missing, and the docker tests build their base image with it: {INSTALL_HINT}")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{tarball.name}.lock", "w") as lock:  # one build at a time (xdist workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tarball.exists():
            return tarball
        return _build(tarball, suite, include)


def _build(tarball: Path, suite: str = SUITE, include: tuple[str, ...] = INCLUDE) -> Path:
    partial = tarball.with_suffix(f".{os.getpid()}.partial.tar")
    try:
        done = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(include)}", suite,
                               str(partial), MIRROR], check=False, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            pytest.fail(f"mmdebstrap failed ({done.returncode}): {done.stderr[-3000:]}")
        partial.rename(tarball)
    finally:
        partial.unlink(missing_ok=True)
    return tarball


def ensure_image(url: str, *, without_python: bool = False) -> str:
    """`rollout-buffer-test-base:<hash>` in the Engine, imported from the tarball when it is not there (or
    `...-nopython:<hash>`, the same rootfs without python3, for the image that cannot run the forwarder)."""
    repo = f"{IMAGE_REPO}-nopython" if without_python else IMAGE_REPO
    name = f"{repo}:{image_tag()}"
    if _request(url, "GET", f"/images/{name}/json")[0] == 200:
        return name
    tarball = base_tarball()
    if without_python:
        tarball = _without_python(tarball)
    try:
        with open(tarball, "rb") as body:
            status, answer = _request(url, "POST", f"/images/create?fromSrc=-&repo={repo}&tag={image_tag()}",
                                      body=body, timeout=300)
    finally:
        if without_python:
            tarball.unlink(missing_ok=True)
    if status != 200 or _request(url, "GET", f"/images/{name}/json")[0] != 200:
        pytest.fail(f"importing {name} failed ({status}): {answer[-2000:]!r}")
    return name


def _without_python(tarball: Path) -> Path:
    out = Path(tempfile.mkstemp(suffix=".tar", dir=CACHE)[1])
    with tarfile.open(tarball) as source, tarfile.open(out, "w") as target:
        for member in source:
            if "python3" in member.name.split("/")[-1] or "/python3" in member.name:
                continue
            target.addfile(member, source.extractfile(member) if member.isfile() else None)
    return out


@contextlib.contextmanager
def docker_environment() -> Iterator[DockerEnv]:
    """The Engine to use (found or started) and the base image in it."""
    found = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    found = found if "://" in found else f"unix://{found}"
    with contextlib.ExitStack() as stack:
        url = found if answers(found) else stack.enter_context(_own_dockerd())
        yield DockerEnv(url=url, image=ensure_image(url))


@pytest.fixture(scope="session")
def docker_env() -> Iterator[DockerEnv]:
    """A running Docker Engine and the test base image (see the module docstring)."""
    with docker_environment() as env:
        yield env


async def container_exists(env: DockerEnv, container_id: str) -> bool:
    """Whether the Engine still has the container (any state)."""
    import aiodocker
    from aiodocker.exceptions import DockerError

    async with aiodocker.Docker(url=env.url) as docker:
        try:
            await docker.containers.get(container_id)
            return True
        except DockerError as exc:
            if exc.status == 404:
                return False
            raise


def docker_sandboxes_of(env: DockerEnv, name_prefix: str) -> list[str]:
    """Ids of sandbox containers (any state) whose name starts with `name_prefix` (a run id)."""
    filters = quote(_json.dumps({"label": ["rollout-buffer.sandbox=1"]}))
    status, body = _request(env.url, "GET", f"/containers/json?all=1&filters={filters}", timeout=30.0)
    assert status == 200, body
    return [c["Id"] for c in _json.loads(body)
            if str((c.get("Labels") or {}).get("rollout-buffer.name", "")).startswith(name_prefix)]
