"""Shared pytest fixtures."""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from rollout_buffer.store.embedded import EmbeddedRedis
from rollout_buffer.store.store import Store
from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from tests.support.backends import external_url_from_env
from tests.support.helpers import ServerProcess, ServerSpec, SlimeLikeDataBuffer
from tests.support.leaks import leftover_check
from tests.support.redis_cluster import LocalRedis, LocalRedisCluster

if TYPE_CHECKING:
    from tests.support.browser import OfflineBrowser

pytest_plugins = ["tests.support.no_skips"]  # RB_FAIL_ON_SKIP=1 (.ci/run): a skipped test fails

# One API process per `serve` unless a test asks for more (flag or env): dozens of servers start in the suite,
# and each further API process costs a server a second or two of imports. Inherited by every `serve`, `demo`
# and walkthrough command the tests start; tests/api/test_api_processes.py starts several on purpose.
os.environ.setdefault("ROLLOUT_BUFFER_API_PROCESSES", "1")

# Deprecation warnings these libraries raise as UserWarning subclasses (so `error::DeprecationWarning` in
# pyproject.toml does not catch them): they only fire on a deprecated use, which would be ours.
LIBRARY_DEPRECATIONS = ("fastapi.exceptions.FastAPIDeprecationWarning",
                        "starlette.exceptions.StarletteDeprecationWarning",
                        "uvicorn.config.UvicornDeprecationWarning")


SUITE_OWNER = pytest.StashKey[bool]()  # this process named the suite run: it stops the suite's dockerd


def pytest_configure(config: pytest.Config) -> None:
    """Name this suite run for its workers (one dockerd for all of them, `tests.support.docker_env`); turn the
    library deprecation warnings above into errors, for the versions that define them."""
    if not hasattr(config, "workerinput"):  # the controller (or the only process): before any worker starts
        import uuid

        from tests.support.docker_env import SUITE_ENV

        if SUITE_ENV not in os.environ:  # a pytest run inside a test keeps its suite's (and does not own it)
            os.environ[SUITE_ENV] = uuid.uuid4().hex
            config.stash[SUITE_OWNER] = True
    for dotted in LIBRARY_DEPRECATIONS:
        module, _, name = dotted.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        config.addinivalue_line("filterwarnings", f"error::{dotted}")


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the last test of this process: nothing it started still runs (`leftover_check`). A run without
    xdist workers owns the suite's dockerd itself: stopped first, as the controller would after its workers."""
    yield
    from tests.support.docker_env import stop_suite_dockerd, suite_dockerd_pid

    if request.config.stash.get(SUITE_OWNER, False) and not os.environ.get("PYTEST_XDIST_WORKER"):
        stop_suite_dockerd()
    leftover_check(kept=suite_dockerd_pid())  # a worker's dockerd serves the suite: the controller stops it


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller stops the suite run's dockerd (if a worker started one) once every worker is done."""
    if config.stash.get(SUITE_OWNER, False):
        from tests.support.docker_env import stop_suite_dockerd

        stop_suite_dockerd()


# The test files that took longest in full runs (seconds of test time at load, longest first): they start first.
LONG_FILES = (
    "tests/api/test_fuzz_api_writes.py",  # ~220
    "tests/chaos/test_chaos_under_load.py",  # ~90-160 (two busy processes of its own)
    "tests/chaos/test_chaos.py",  # ~100 (two rounds)
    "tests/agents/test_harbor_cookbook.py",  # ~60 (five images built, three checks, one run)
    "tests/agents/test_fleet.py",  # ~60 (three Docker Engines in network namespaces)
    "tests/agents/test_harbor_cli_presets.py",  # ~50
    "tests/agents/test_harbor_tb2.py",  # ~35 (a Debian trixie image built once per checkout)
    "tests/agents/test_harbor_tb2_build.py",  # ~40 (a build that apt-installs pip, two runs, two checks)
    "tests/agents/test_reward_integrity.py",  # ~130 at load (Harbor verifications in every mode)
    "tests/adapter/test_dynamic_filter.py",  # up to ~180
    "tests/api/test_fuzz_api.py",  # ~190
    "tests/remote/test_remote_protocol.py",  # ~130
    "tests/store/test_handover.py",  # ~120
    "tests/api/test_fuzz_api_gateway.py",  # ~110
    "tests/agents/test_agent_command_claude_code.py",  # ~100
    "tests/security/test_auth.py",  # ~90
    "tests/cli/test_readme_walkthrough.py",
    "tests/api/test_gateway_durability.py",
    "tests/runs/test_core_lifecycle.py",
    "tests/agents/test_agent_command_runs.py",
    "tests/runtime/test_runtime_workers.py",
    "tests/testing/test_tokenizer_fixture.py",
    "tests/cli/test_quiet_start.py",
    "tests/runtime/test_sglang_router.py",
    "tests/runtime/test_worker_processes.py",
    "tests/agents/test_agent_command_demo.py",
    "tests/runs/test_run_lifecycle.py",
    "tests/api/test_core_api.py",
    "tests/runs/test_exactly_once.py",
    "tests/adapter/test_agent_rollout_e2e.py",
    "tests/api/test_no_500_from_input.py",
    "tests/store/test_replica_wait_paths.py",
    "tests/agents/test_long_streams.py",
    "tests/adapter/test_loss_mask.py",
    "tests/agents/test_mini_swe_agent.py",
    "tests/agents/test_agent_trust.py",
    "tests/runtime/test_runtime_e2e.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that take longest run first (`LONG_FILES`, in that order), the rest in collection order:
    pytest-xdist hands out whole files in this order (`--dist loadfile --no-loadscope-reorder`), so a long file
    collected last would keep one worker busy while the others have nothing left to run (xdist's default
    order, by test count, started the one-test chaos and long-stream files last). Only the order changes."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: ties keep order


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module whose `SERVER` names several Redis backends runs its tests once per backend."""
    spec = getattr(metafunc.module, "SERVER", None)
    if isinstance(spec, ServerSpec) and len(spec.backends) > 1 and "server" in metafunc.fixturenames:
        metafunc.parametrize("server", spec.backends, indirect=True, scope="module")


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The test module's `rollout-buffer serve` process, started as its `SERVER` (a `ServerSpec`) says, once
    per module (and per backend)."""
    from tests.support.backends import backend

    spec = getattr(request.module, "SERVER", None)
    if not isinstance(spec, ServerSpec):
        raise pytest.UsageError(f"{request.module.__name__} uses `server` but sets no SERVER = ServerSpec(...)")
    if spec.shared is not None:
        yield request.getfixturevalue(spec.shared)
        return
    args = list(spec.args)
    if spec.task_files:
        folder = tmp_path_factory.mktemp("tasks")
        for name, source in spec.task_files.items():
            (folder / name).write_text(source)
        args += ["--task-dir", str(folder)]
    name = getattr(request, "param", spec.backends[0])
    args += spec.variants[name] if name in spec.variants else backend(request, name).server_args()
    if spec.cwd_fixture is not None:
        cwd = request.getfixturevalue(spec.cwd_fixture)[spec.cwd_key]
        process = ServerProcess(Path(spec.data_dir), *args, env=spec.env, cwd=cwd)
    else:
        process = ServerProcess(tmp_path_factory.mktemp("server") / spec.data_dir, *args, env=spec.env)
    with process as proc:
        yield proc


@pytest.fixture()
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    """An HTTP client on the module's server."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """The real Qwen2.5 fast tokenizer (built offline once per machine)."""
    return load_qwen_tokenizer("qwen2.5")


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """The real Qwen3 fast tokenizer, with <think> and <tool_response> added tokens."""
    return load_qwen_tokenizer("qwen3")


@pytest.fixture(scope="session")
def r1_tokenizer() -> Any:
    """The DeepSeek-R1-Distill-Qwen tokenizer (Qwen vocabulary, R1 markers)."""
    return load_qwen_tokenizer("r1_distill")


@pytest.fixture()
def offline_browser(tmp_path: Path) -> Iterator[OfflineBrowser]:
    """Headless Chromium with outbound network blocked and a fresh profile (see tests/support/browser.py):
    `offline_browser.open(url, wait_for=selector)` -> a `PageVisit` with every request the page made;
    `visit.screenshot(name)` saves under this test's tmp dir."""
    from tests.support.browser import OfflineBrowser  # playwright is imported only by the tests that use it

    with OfflineBrowser(tmp_path) as browser:
        yield browser


@pytest.fixture()
def slime_data_buffer() -> type[SlimeLikeDataBuffer]:
    """The slime-like data buffer class (instantiate with the metadata to resume from)."""
    return SlimeLikeDataBuffer


@pytest.fixture()
def tiny_server() -> Any:
    """Start small aiohttp apps on loopback, each on its own loop in a thread: `start(app) -> url`.

    For answers a real buffer never gives (malformed bodies, hangs, 5xx, ignoring `num`)."""
    import asyncio
    import threading

    from aiohttp import web

    started: list[tuple[asyncio.AbstractEventLoop, web.AppRunner, threading.Thread]] = []

    def start(app: web.Application) -> str:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()

        async def setup() -> tuple[web.AppRunner, int]:
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        runner, port = asyncio.run_coroutine_threadsafe(setup(), loop).result(timeout=10)
        started.append((loop, runner, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for loop, runner, thread in started:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture(scope="session")
def qwen_tokenizer_path() -> str:
    """Directory of the Qwen2.5 tokenizer, as a `/start_rollout` `tokenizer_path`."""
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    return str(qwen_tokenizer_dir("qwen2.5"))


@pytest.fixture(scope="module")
def rollout_engine() -> Any:
    """An SGLang-protocol test engine on loopback (in a thread), latency 0; tests reconfigure it."""
    from rollout_buffer.testing.engine import run_engine_in_thread

    with run_engine_in_thread(template="qwen2.5", seed=7) as engine:
        yield engine


@pytest.fixture(scope="session")
def runtime_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `rollout-buffer serve` process (in-process workers) shared by the runtime tests, with the test
    task folders; tests use their own run ids, so they do not see each other's data."""
    from tests.support.helpers import ServerProcess
    from tests.support.runtime_helpers import RUNTIME_SERVER_ARGS

    with ServerProcess(tmp_path_factory.mktemp("runtime-data"), *RUNTIME_SERVER_ARGS) as proc:
        yield proc


@pytest.fixture(scope="session")
def external_buffer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `rollout-buffer serve` process with the test task modules (records come from the tests),
    shared by the agent-rollout test modules; every test there uses its own run id."""
    from pathlib import Path

    from tests.support.helpers import ServerProcess

    with ServerProcess(tmp_path_factory.mktemp("agent-buffer"), "--task-dir",
                       str(Path(__file__).parent / "fixtures" / "tasks")) as proc:
        yield proc


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A real 3-node Redis Cluster on loopback, started once per session (see tests/support/redis_cluster.py and
    tests/support/backends.py for how tests share it)."""
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def external_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an external (non-embedded) Redis: CI's `REDIS_URL` when set, else a plain `redis-server`
    on a loopback port started once per session (tests/support/backends.py)."""
    url = external_url_from_env()
    if url:
        yield url
        return
    with LocalRedis(tmp_path_factory.mktemp("external-redis")) as server:
        yield server.url


@pytest.fixture(params=["embedded", "cluster"])
async def redis_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A Store on its own embedded Redis in a temp dir, or on the session's Redis Cluster (emptied first)."""
    if request.param == "cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        store = await Store.open(cluster.url, cluster=True)
        try:
            yield store
        finally:
            await store.close()
        return
    embedded = EmbeddedRedis(tmp_path / "redis")
    store = Store.from_url(embedded.start())
    try:
        yield store
    finally:
        await store.close()
        embedded.stop()


@pytest.fixture()
def logged_metrics(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The `rollout/` metrics each trainer step logs (`generate_rollout` returns them to slime too)."""
    from slime_adapter.hooks import agent_rollout

    seen: list[dict[str, Any]] = []
    real = agent_rollout.log_raw_info

    def capture(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(agent_rollout, "log_raw_info", capture)
    return seen
