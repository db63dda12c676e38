"""A Harbor image build reaches the hosts the operator grants builds (`--egress-build`) and nothing else.

Real Docker (the Engine's legacy builder), the real egress proxy and in-sandbox forwarder, and the Terminal-Bench 2
stand-ins on loopback (`tests/support/tb2_mirror.py`: a Debian archive for deb.debian.org, a PyPI for pypi.org
under a test CA the trixie base image trusts). A granted download lands in the image; a host not granted fails
the build as `BuildFailed` naming it; a RUN step reaches no host loopback port but the forwarder's; with no grant
the build has no network at all; the holder container is gone after every build."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from rollout_buffer.agents.harbor.build_net import HOLDER_LABEL, BuildEgress, base_image
from rollout_buffer.agents.harbor.images import BuildFailed, Recipe, ensure_image
from rollout_buffer.agents.sandbox import EGRESS_PORT, SandboxError
from tests.support.docker_env import DockerEnv, _request, docker_env  # noqa: F401 - the session fixture
from tests.support.helpers import REPO
from tests.support.registry import remove_image
from tests.support.tb2_mirror import Mirror, running_mirror
from tests.support.tb2_mirror import base_image as tb2_base

pytestmark = pytest.mark.timeout(300)
RELEASE = "http://deb.debian.org/debian/dists/trixie/Release"


@pytest.fixture(scope="module")
def mirror() -> Iterator[Mirror]:
    with running_mirror() as running:
        yield running


@pytest.fixture(scope="module")
def trixie(docker_env: DockerEnv) -> str:  # noqa: F811
    return tb2_base(docker_env.url)


def grant(mirror: Mirror, *hosts: str) -> BuildEgress:
    """Builds granted `hosts`, with the stand-ins as every TB2 host's mirror."""
    return BuildEgress(hosts, tuple(mirror.mirrors()))


def holders(env: DockerEnv, task: str | None = None) -> list[str]:
    """The Engine's build holders (of `task`'s builds only, when named: other files' builds may run at once)."""
    filters = quote(json.dumps({"label": [f"{HOLDER_LABEL}=1"]}))
    status, body = _request(env.url, "GET", f"/containers/json?all=1&filters={filters}", timeout=30.0)
    assert status == 200, body
    return [c["Id"] for c in json.loads(body)
            if task is None or (c.get("Labels") or {}).get("rollout-buffer.name") == f"build-egress {task}"]


def build(env: DockerEnv, root: Path, dockerfile: str, egress: BuildEgress | None) -> str:
    """Build `dockerfile` as a Harbor task's environment/ (a fresh tag); the tag. The holder is gone after."""
    (root / "environment").mkdir(parents=True)
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    tag = f"rollout-buffer-harbor/build-egress-test:{uuid.uuid4().hex[:12]}"
    recipe = Recipe(f"harbor task {root.name!r}", root / "environment", timeout_s=120.0, task=root.name, egress=egress)
    try:
        asyncio.run(ensure_image(tag, recipe, env.options()))
    finally:
        assert holders(env, root.name) == []  # removed whatever the outcome
    return tag


def read_in_image(env: DockerEnv, tag: str, path: str) -> str:
    """A file of the built image (through a container with no network), and the image removed after."""
    try:
        done = subprocess.run(["docker", "-H", env.url, "run", "--rm", "--network", "none", tag, "cat", path],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout
    finally:
        remove_image(env.url, tag)


def test_a_granted_host_is_reached_by_apt_curl_and_https_and_the_download_is_in_the_image(
        docker_env: DockerEnv, mirror: Mirror, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    dockerfile = (f"FROM {trixie}\nRUN apt-get update && curl -fsS {RELEASE} -o /release.txt "
                  "&& curl -fsS https://pypi.org/simple/pytest/ -o /pytest.html && env | grep -ci _proxy > /proxies\n")
    tag = build(docker_env, tmp_path / "granted", dockerfile, grant(mirror, "deb.debian.org", "pypi.org"))
    history = subprocess.run(["docker", "-H", docker_env.url, "history", "--no-trunc", tag], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    config = json.loads(_request(docker_env.url, "GET", f"/images/{tag}/json")[1])["Config"]
    assert str(EGRESS_PORT) not in history and not any("PROXY" in e.upper() for e in config.get("Env") or [])
    assert read_in_image(docker_env, tag, "/release.txt").startswith("Origin: rollout-buffer test mirror")
    assert {"deb.debian.org/debian/dists/trixie/Release", "pypi.org/simple/pytest/"} <= set(mirror.served)


def test_a_host_not_granted_fails_the_build_naming_it(
        docker_env: DockerEnv, mirror: Mirror, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    dockerfile = f"FROM {trixie}\nRUN curl -fsS {RELEASE} -o /release.txt\n"
    with pytest.raises(BuildFailed) as failed:
        build(docker_env, tmp_path / "refused", dockerfile, grant(mirror, "pypi.org"))
    assert isinstance(failed.value, SandboxError)  # an infrastructure failure of the task, never a reward
    message = str(failed.value)
    assert "harbor task 'refused'" in message and "build failed" in message
    assert "the build's egress refused ['deb.debian.org:80']: grant them with --egress-build" in message


def test_a_run_step_reaches_no_host_loopback_port_but_the_forwarder(
        docker_env: DockerEnv, mirror: Mirror, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    listener = socket.create_server(("127.0.0.1", 0))  # a host service (Redis, the API) on loopback
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    probe = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', PORT), 3).close(); print('reached')\n"
             "except OSError as e:\n    print('unreachable', type(e).__name__)\n").replace("PORT", str(port))
    (tmp_path / "loopback" / "environment").mkdir(parents=True)
    (tmp_path / "loopback" / "environment" / "probe.py").write_text(probe)
    dockerfile = (f"FROM {trixie}\nCOPY probe.py /probe.py\nRUN python3 /probe.py > /direct; "
                  f"curl -sS -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/ > /proxied; "
                  f"cat /direct /proxied > /result\n")
    (tmp_path / "loopback" / "environment" / "Dockerfile").write_text(dockerfile)
    tag = f"rollout-buffer-harbor/build-egress-test:{uuid.uuid4().hex[:12]}"
    recipe = Recipe("harbor task 'loopback'", tmp_path / "loopback" / "environment", timeout_s=120.0,
                    task="loopback", egress=grant(mirror, "deb.debian.org"))
    try:
        asyncio.run(ensure_image(tag, recipe, docker_env.options()))
        result = read_in_image(docker_env, tag, "/result")
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing of the build ever connected
    finally:
        listener.close()
    assert result.startswith("unreachable ConnectionRefusedError") and result.endswith("403"), result
    assert holders(docker_env, "loopback") == []


def test_without_a_build_grant_the_build_has_no_network(
        docker_env: DockerEnv, mirror: Mirror, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    dockerfile = (f"FROM {trixie}\nRUN (grep -c : /proc/net/dev; env | grep -ci _proxy; "
                  f"curl -sS -m 5 {RELEASE} -o /dev/null && echo fetched || echo failed) > /net\n")
    tag = build(docker_env, tmp_path / "none", dockerfile, None)
    # one interface (lo), no proxy variable, and the download fails
    assert read_in_image(docker_env, tag, "/net").split() == ["1", "0", "failed"]


def test_a_base_image_missing_from_the_engine_is_a_build_failure_naming_it(
        docker_env: DockerEnv, mirror: Mirror, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(BuildFailed) as failed:
        build(docker_env, tmp_path / "nobase", "FROM rollout-buffer-test-absent:none\nRUN true\n",
              grant(mirror, "pypi.org"))
    assert "base image 'rollout-buffer-test-absent:none', which is not in the Docker Engine" in str(failed.value)


def test_the_holder_runs_the_first_real_stage_base() -> None:
    text = "ARG X=1\nFROM golang:1 AS tools\nFROM tools AS b\nfrom  --platform=linux/amd64 debian:trixie as final\n"
    assert base_image(text) == "golang:1"
    assert base_image("FROM scratch AS s\nFROM s\nFROM python:3.13 AS p\n") == "python:3.13"
    assert base_image("# no FROM\n") is None


def test_tasks_check_build_takes_the_build_grant(
        docker_env: DockerEnv, mirror: Mirror, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    task = tmp_path / "fetches"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Nothing.\n")
    # a task that allows its container no internet: its build still reaches what the operator grants builds
    (task / "task.toml").write_text('version = "1.0"\n\n[environment]\nbuild_timeout_sec = 120.0\n'
                                    'allow_internet = false\n')
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task / "environment" / "Dockerfile").write_text(f"FROM {trixie}\nRUN curl -fsS {RELEASE} -o /r.txt\n")

    def check(*grants: str) -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", str(task), "--build",
                               "--docker-host", docker_env.url, "--json", *grants], cwd=REPO, capture_output=True,
                              text=True, timeout=200, check=False)
        return done.returncode, json.loads(done.stdout or "{}")

    mirrors = [a for m in mirror.mirrors() for a in ("--egress-mirror", m)]
    code, report = check("--egress-build", "pypi.org", *mirrors)  # deb.debian.org not granted
    row = report["tasks"][0]
    assert code == 1 and row["image"] == "failed", report
    assert "refused ['deb.debian.org:80']" in row["problems"][0]["message"] and "--egress-build" in row["problems"][0]["message"]
    code, report = check("--egress-build", "deb.debian.org", *mirrors)
    row = report["tasks"][0]
    assert code == 0 and row["image"].startswith("rollout-buffer-harbor/fetches:"), report
    remove_image(docker_env.url, row["image"])
    assert holders(docker_env, "fetches") == []


def test_egress_build_reaches_a_worker_from_the_command_line_and_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_buffer.cli import build_parser, settings_from
    from rollout_buffer.security.access import AccessPolicy
    from rollout_buffer.settings import Settings
    from rollout_buffer.tasks.contract import ServerFacts

    args = build_parser().parse_args(["worker", "--egress-build", "deb.debian.org", "--egress-build", "*.pypi.org:443",
                                      "--egress-mirror", "deb.debian.org=10.0.0.6:80",
                                      "--egress-proxy", "http://proxy.internal:3128"])
    access = AccessPolicy.from_settings(settings_from(args))
    server = ServerFacts(egress_build=access.egress_build, egress_mirror=access.egress_mirror,
                         egress_proxy=access.egress_proxy)
    assert BuildEgress.of(server) == BuildEgress(("deb.debian.org", "*.pypi.org:443"), ("deb.debian.org=10.0.0.6:80",),
                                                 "http://proxy.internal:3128")  # the phases' mirrors and upstream
    assert BuildEgress.of(ServerFacts()) is None  # no grant: the build has no network
    monkeypatch.setenv("ROLLOUT_BUFFER_EGRESS_BUILD", "deb.debian.org, pypi.org")
    assert Settings().egress_build == ["deb.debian.org", "pypi.org"]
    with pytest.raises(ValueError, match="egress host 'http://x': give host"):
        Settings(egress_build=["http://x"])


def test_a_holder_runs_unprivileged_and_one_a_dead_worker_left_is_swept(
        docker_env: DockerEnv, trixie: str, tmp_path: Path) -> None:  # noqa: F811
    from rollout_buffer.agents import docker_engine as engine
    from rollout_buffer.agents.harbor.build_net import holder_spec

    owner = f"rb-test-holder-{uuid.uuid4().hex[:8]}"
    spec = holder_spec(trixie, str(tmp_path / "egress.sock"), 60.0, owner, "sweep")
    host = spec["HostConfig"]
    assert spec["User"] == engine.KEEPER_USER and host["CapDrop"] == ["ALL"] and host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] and host["SecurityOpt"] == ["no-new-privileges"] and not host["Privileged"]
    spec["Labels"].update({engine.WORKER_LABEL: "999999999:1", engine.LIFE_LABEL: "an-earlier-life"})  # a dead worker's

    async def left_and_swept() -> tuple[str, list[str], int]:
        docker = engine.connect(docker_env.options())
        try:
            holder = await docker.containers.create(spec, name=engine.container_name("build-egress-sweep"))
            left = holders(docker_env, "sweep")  # found by the name the tests look for holders by
            return holder.id, left, await engine.remove_stale_containers(owner, docker_env.options())
        finally:
            await docker.close()

    holder_id, left, removed = asyncio.run(left_and_swept())
    assert holder_id in left and removed == 1 and holder_id not in holders(docker_env)


def test_a_base_image_without_python3_is_a_build_failure_naming_it(
        docker_env: DockerEnv, mirror: Mirror, tmp_path: Path) -> None:  # noqa: F811
    image = docker_env.image_without_python()  # the forwarder's python3 is what the holder runs, as a sandbox's
    with pytest.raises(BuildFailed) as failed:
        build(docker_env, tmp_path / "nopython", f"FROM {image}\nRUN true\n", grant(mirror, "pypi.org"))
    assert f"base image {image!r}, which cannot run its python3" in str(failed.value), str(failed.value)


def test_tasks_check_refuses_a_bad_build_grant_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_buffer.agents.harbor.check import cli_main

    with pytest.raises(SystemExit) as exited:
        cli_main(["check", str(tmp_path), "--build", "--egress-build", "http://deb.debian.org"])
    assert exited.value.code == 2
    assert "egress allowlist entry 'http://deb.debian.org': use host, host:port or *.domain" in capsys.readouterr().err
