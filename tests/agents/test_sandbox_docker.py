"""The docker sandbox backend with real containers: a benign command, an exact environment, files kept
inside, and a hostile agent that tries every door (host ports, the internet, host processes and files, a
fork bomb, a full disk, the read-only root, a setsid process that ignores SIGTERM): each stays shut. The
model socket is the one way out; cleanup and the stale-container sweep leave no container behind."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import textwrap
from pathlib import Path

import aiodocker
import pytest
from aiohttp import web

from rollout_buffer.agents import docker_engine as engine
from rollout_buffer.agents import docker_procs, docker_sandbox
from rollout_buffer.agents.docker_sandbox import DockerSandbox
from rollout_buffer.agents.sandbox import Limits, SandboxError, is_isolated, open_sandbox
from tests.support.docker_env import DockerEnv, container_exists, docker_env  # noqa: F401 - the session fixture

# the session's first run builds the base image (tests/support/docker_env.py) inside the first test's setup
pytestmark = pytest.mark.timeout(600)
LIMITS = Limits(pids=64, disk_mb=16, memory_bytes=256 << 20, cpus=1.0)


async def _box(env: DockerEnv, limits: Limits = LIMITS, **options: object) -> DockerSandbox:
    return await open_sandbox("docker", name="test/box", limits=limits, options=env.options(**options))


async def test_benign_command_and_exact_environment(docker_env: DockerEnv,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_SECRET_TOKEN", "do-not-leak")
    assert is_isolated("docker")
    box = await _box(docker_env, Limits(pids=64, disk_mb=16, output_bytes=1000))
    try:
        run = await box.exec(["bash", "-c", "env; pwd; id -u; echo oops >&2; exit 7"], timeout_s=20,
                             env={"ANTHROPIC_API_KEY": "k1"})
        big = await box.exec(["bash", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo END"], timeout_s=20)
        await box.write_file("sub/f", "")
        sub = await box.exec(["pwd"], timeout_s=20, cwd="sub")
    finally:
        await box.cleanup()
    lines = run.stdout.splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    assert run.exit_code == 7 and not run.timed_out and run.stderr == "oops\n"
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PWD", "SHLVL", "_", "ANTHROPIC_API_KEY"}
    assert env["ANTHROPIC_API_KEY"] == "k1" and env["HOME"] == box.home == "/home/agent"
    assert lines[-2:] == [box.work, "1000"] and box.work == "/app"
    assert big.ok and big.truncated and big.output_bytes == 100004 and big.stdout.endswith("xxxEND\n")
    assert len(big.stdout) == 1000
    assert sub.stdout == "/app/sub\n"
    assert not await container_exists(docker_env, box.container_id), "cleanup removes the container"


async def test_files_stay_inside(docker_env: DockerEnv) -> None:  # noqa: F811
    box = await _box(docker_env)
    try:
        await box.write_file("src/a.txt", "hello")
        await box.write_file("~/.config/x", b"\x00\xffbin")
        assert await box.read_file("src/a.txt") == b"hello" == await box.read_file("/app/src/a.txt")
        assert await box.read_file("~/.config/x") == b"\x00\xffbin"
        listed = await box.exec(["bash", "-c", "cat src/a.txt; stat -c %u src/a.txt"], timeout_s=20)
        assert listed.stdout == "hello1000\n"
        for bad in ("../etc/passwd", "/etc/passwd", "~/../../etc/shadow", "src/../../x"):
            with pytest.raises(SandboxError, match="leaves the sandbox"):
                await box.read_file(bad)
            with pytest.raises(SandboxError, match="leaves the sandbox"):
                await box.write_file(bad, "x")
        with pytest.raises(FileNotFoundError):
            await box.read_file("missing.txt")
    finally:
        await box.cleanup()
        await box.cleanup()  # safe twice


PROBE = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    port, secret_path, token = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    found = {}
    def connect(host, port):
        try:
            socket.create_connection((host, port), 2).close()
            return "connected"
        except OSError as exc:
            return type(exc).__name__
    found["host_port"] = connect("127.0.0.1", port)
    found["internet"] = connect("1.1.1.1", 80)
    try:
        socket.getaddrinfo("deb.debian.org", 80)
        found["dns"] = "resolved"
    except OSError as exc:
        found["dns"] = type(exc).__name__
    found["interfaces"] = sorted(os.listdir("/sys/class/net"))
    found["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    found["cmdlines"] = []
    for pid in found["pids"]:
        try:
            found["cmdlines"].append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
        except OSError:
            pass
    found["secret_path"] = os.path.exists(secret_path)
    grep = subprocess.run(["grep", "-rlsF", "--exclude-dir=proc", "--exclude-dir=sys", token, "/"],
                          capture_output=True, text=True)
    found["secret_found"] = grep.stdout.split()
    try:
        open("/etc/evil", "w")
        found["root_write"] = "written"
    except OSError as exc:
        found["root_write"] = exc.strerror
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    found["cap_eff"], found["no_new_privs"] = status["CapEff"].strip(), status["NoNewPrivs"].strip()
    found["uid"] = os.getuid()
    for place in ("/app", "/tmp", "/dev/shm", os.environ["HOME"]):
        fill = subprocess.run(["dd", "if=/dev/zero", f"of={place}/fill", "bs=1M", "count=64"],
                              capture_output=True, text=True)
        found[f"fill:{place}"] = [fill.returncode, os.path.getsize(f"{place}/fill")]
        os.unlink(f"{place}/fill")
    print(json.dumps(found))
""")


async def test_hostile_agent_finds_every_door_shut(docker_env: DockerEnv, tmp_path: Path) -> None:  # noqa: F811
    token = secrets.token_hex(16)
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    arrived: list[bool] = []
    server = await asyncio.start_server(lambda r, w: (arrived.append(True), w.close()), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    box = await _box(docker_env)
    try:
        await box.write_file("probe.py", PROBE)
        run = await box.exec(["python3", "probe.py", str(port), str(secret), token], timeout_s=40)
    finally:
        await box.cleanup()
        server.close()
    assert run.exit_code == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["host_port"] != "connected" and not arrived, "a host loopback port is reachable"
    assert found["internet"] != "connected" and found["dns"] != "resolved"
    assert found["interfaces"] == ["lo"]
    programs = {cmdline.split()[0] for cmdline in found["cmdlines"]}
    assert programs == {"/sbin/docker-init", "timeout", "cat", "python3"}, found["cmdlines"]  # its own only
    assert len(found["pids"]) < 10, "only the container's own processes are visible"
    assert found["secret_path"] is False and found["secret_found"] == []
    assert found["root_write"] == "Read-only file system"
    assert found["cap_eff"] == "0000000000000000" and found["no_new_privs"] == "1" and found["uid"] == 1000
    for place in ("/app", "/tmp", "/dev/shm", "/home/agent"):
        code, size = found[f"fill:{place}"]
        assert code != 0 and size <= 16 << 20, f"{place}: {found[f'fill:{place}']}"


# forks children that fork forever (holding every pid), prints how many it made, then keeps trying
FORK_BOMB = textwrap.dedent("""
    import os
    made = 0
    while True:
        try:
            if os.fork() == 0:
                while True:
                    try:
                        os.fork()
                    except OSError:
                        pass
            made += 1
        except OSError:
            break
    print(made, flush=True)
    while True:
        try:
            os.fork()
        except OSError:
            pass
""")


async def test_fork_bomb_is_bounded_and_killed(docker_env: DockerEnv) -> None:  # noqa: F811
    box = await _box(docker_env)
    try:
        bomb = await box.exec(["python3", "-c", FORK_BOMB], timeout_s=3)
        assert bomb.timed_out and bomb.extra == {"killed": True}, bomb
        assert 0 < int(bomb.stdout) < LIMITS.pids, "the pids limit bounds the bomb"
        assert await box.agent_pids() == []
        after = await box.exec(["bash", "-c", "echo alive"], timeout_s=10)
        assert after.stdout == "alive\n", "the sandbox survives its agent's fork bomb"
    finally:
        await box.cleanup()
    assert not await container_exists(docker_env, box.container_id)


async def test_setsid_process_ignoring_sigterm_dies_at_the_deadline(docker_env: DockerEnv) -> None:  # noqa: F811
    box = await _box(docker_env)
    script = "setsid bash -c 'trap \"\" TERM HUP; exec sleep 300' & trap '' TERM; echo started; sleep 300"
    try:
        run = await box.exec(["bash", "-c", script], timeout_s=2)
        assert run.timed_out and run.extra == {"killed": True} and run.stdout == "started\n"
        assert 2 <= run.duration_s < 10
        assert await box.agent_pids() == []
        after = await box.exec(["bash", "-c", "echo alive"], timeout_s=10)
        assert after.ok and after.stdout == "alive\n", "the container outlives a command's deadline"
        left = await box.exec(["bash", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo bg"], timeout_s=10)
        assert left.ok and await box.agent_pids() == [], "what a finished command left is killed too"
    finally:
        await box.cleanup()
    assert not await container_exists(docker_env, box.container_id)


KILL_FORWARDER = textwrap.dedent("""
    import os, signal, urllib.request
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        if b"forwarder.py" in open(f"/proc/{pid}/cmdline", "rb").read():
            try:
                os.kill(int(pid), signal.SIGKILL)
                print("killed")
            except PermissionError as exc:
                print(type(exc).__name__)
    urllib.request.urlopen("http://127.0.0.1:8765/v1/y", timeout=10).read()
""")


async def test_cancel_kills_the_command_and_lifetime_removes_the_container(docker_env: DockerEnv) -> None:  # noqa: F811
    box = await _box(docker_env, lifetime_s=4)
    try:
        running = asyncio.create_task(box.exec(["bash", "-c", "setsid sleep 300 & sleep 300"], timeout_s=60))
        await asyncio.sleep(1.0)
        assert len(await box.agent_pids()) >= 2
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await box.agent_pids() == [], "a cancelled command leaves nothing running"
        for _ in range(100):  # the container's main process ends at its lifetime and the container goes
            if not await container_exists(docker_env, box.container_id):
                break
            await asyncio.sleep(0.1)
        assert not await container_exists(docker_env, box.container_id), "the container outlived its lifetime"
    finally:
        await box.cleanup()


WORKER = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from rollout_buffer.agents.sandbox import Limits, open_sandbox
    async def main():
        box = await open_sandbox("docker", name="dying-worker", limits=Limits(), options=json.loads(sys.argv[1]))
        await box.exec(["bash", "-c", "setsid sleep 300 >/dev/null 2>&1 &"], timeout_s=20)
        print(box.container_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies without cleaning up
    asyncio.run(main())
""")


async def test_container_goes_when_its_worker_dies(docker_env: DockerEnv) -> None:  # noqa: F811
    worker = await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, json.dumps(docker_env.options()),
                                                  stdout=asyncio.subprocess.PIPE)
    container_id = (await worker.stdout.readline()).decode().strip()
    assert await worker.wait() == -9 and container_id
    for _ in range(100):
        if not await container_exists(docker_env, container_id):
            break
        await asyncio.sleep(0.1)
    assert not await container_exists(docker_env, container_id), "a dead worker's container lives on"


async def test_container_is_stopped_when_nothing_can_be_killed_inside(docker_env: DockerEnv,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_procs, "KILL_BUDGET_S", 0.0)  # as if every pid stayed taken
    box = await _box(docker_env)
    try:
        run = await box.exec(["bash", "-c", "trap '' TERM; sleep 300"], timeout_s=1)
        assert run.timed_out and run.extra == {"killed": True, "container_stopped": True}
        with pytest.raises(SandboxError, match="stopped"):
            await box.exec(["true"], timeout_s=5)
    finally:
        await box.cleanup()
    assert not await container_exists(docker_env, box.container_id)


async def test_model_socket_is_the_one_way_out(docker_env: DockerEnv, tmp_path: Path) -> None:  # noqa: F811
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        return web.json_response({"relay": "ok", "path": request.path})

    folder = tmp_path / "relay"
    folder.mkdir(mode=0o755)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(folder / "model.sock")).start()
    os.chmod(folder / "model.sock", 0o666)
    box = await open_sandbox("docker", name="model", limits=LIMITS, options=docker_env.options(),
                             model_socket=str(folder / "model.sock"))
    try:
        assert box.model_url == "http://127.0.0.1:8765"
        code = f"import urllib.request; print(urllib.request.urlopen('{box.model_url}/v1/x', timeout=10).read().decode())"
        run = await box.exec(["python3", "-c", code], timeout_s=30)
        assert run.ok, run.stderr
        assert json.loads(run.stdout) == {"relay": "ok", "path": "/v1/x"} and seen == ["GET /v1/x"]
        attack = await box.exec(["python3", "-c", KILL_FORWARDER], timeout_s=30)
        assert attack.ok and attack.stdout == "PermissionError\n", attack.stderr
        assert seen[-1] == "GET /v1/y", "the agent cannot kill the forwarder"
    finally:
        await box.cleanup()
        await runner.cleanup()


async def test_stale_containers_are_removed_by_label(docker_env: DockerEnv) -> None:  # noqa: F811
    owner = f"test-{secrets.token_hex(4)}"
    live = await _box(docker_env, owner=owner)
    spec = {"Image": docker_env.image, "Entrypoint": ["sleep"], "Cmd": ["300"], "HostConfig": {"NetworkMode": "none"},
            "Labels": {engine.LABEL: "1", engine.OWNER_LABEL: owner, engine.LIFE_LABEL: "an-earlier-life"}}
    async with aiodocker.Docker(url=docker_env.url) as docker:
        leftover = await docker.containers.create(spec)  # its worker died: its main process never runs again
        sibling = await docker.containers.create({**spec, "Labels": {**spec["Labels"], engine.LIFE_LABEL: "sibling"}})
        await sibling.start()  # another worker process's live sandbox on the same host
    try:
        assert await docker_sandbox.remove_stale_containers(owner, {"docker_host": docker_env.url}) == 1
        assert not await container_exists(docker_env, leftover.id)
        assert await container_exists(docker_env, live.container_id), "this life's own sandboxes are kept"
        assert await container_exists(docker_env, sibling.id), "a sibling worker's running sandbox is kept"
    finally:
        await live.cleanup()
        async with aiodocker.Docker(url=docker_env.url) as docker:
            await (await docker.containers.get(sibling.id)).delete(force=True)


async def test_missing_image_and_unreachable_engine(docker_env: DockerEnv, tmp_path: Path) -> None:  # noqa: F811
    options = {"docker_host": docker_env.url}
    assert await docker_sandbox.image_exists(docker_env.image, options) is True
    assert await docker_sandbox.image_exists("rollout-buffer-no-such-image:0", options) is False
    with pytest.raises(SandboxError, match="not in the Docker Engine"):
        await open_sandbox("docker", name="x", limits=LIMITS, options=docker_env.options(
            image="rollout-buffer-no-such-image:0"))
    name = f"no-python-{secrets.token_hex(4)}"
    with pytest.raises(SandboxError, match="has no working python3"):
        await open_sandbox("docker", name=name, limits=LIMITS, model_socket=str(tmp_path / "model.sock"),
                           options=docker_env.options(image=docker_env.image_without_python()))
    async with aiodocker.Docker(url=docker_env.url) as docker:
        left = await docker.containers.list(all=True, filters=json.dumps({"label": [f"rollout-buffer.name={name}"]}))
    assert left == [], "a sandbox that failed to start leaves no container"
    with pytest.raises(SandboxError, match="unreachable"):
        await open_sandbox("docker", name="x", limits=LIMITS, options={
            "image": docker_env.image, "docker_host": f"unix://{tmp_path}/none.sock"})
