"""Every URL the server calls, or hands a task module to call, obeys `--allow-url` (`rollout_buffer.security.outbound`):

* an engine list (text separated by spaces or commas, or a JSON list) is checked engine by engine, after
  the same parsing the calls use, so an allowed first URL cannot carry another host in behind it;
* a slime-style module is handed the server's own write URL (its socket address, not the `Host` header),
  or the client's `remote_buffer_url` only when `--allow-url` allows it: the run's write key goes nowhere
  else;
* `abort_in_flight` aborts at every engine of the run's list and reports each one;
* a remote rollout's completion callback outside `--allow-url` is recorded as failed, never sent.

Real parts: a served app with a token and `--allow-url`, three test engines (two allowed, one not) whose
per-endpoint counters show what reached them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from rollout_buffer.remote.callback import CallbackSender
from rollout_buffer.remote.schema import InitRequest
from rollout_buffer.remote.settings import RemoteSettings
from rollout_buffer.remote.state import RemoteStates
from rollout_buffer.runtime.worker import load_handle
from rollout_buffer.security.access import AccessDenied, AccessPolicy
from rollout_buffer.security.outbound import abort_targets, buffer_url_for, checked_engine_urls, own_base_url
from rollout_buffer.settings import Settings
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.discovery import discover
from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.wire.schema import StartRolloutRequest
from tests.support.helpers import REPO, ServerProcess, free_port
from tests.support.runtime_helpers import LEGACY_TASKS, RUNTIME_TASKS, arithmetic_rows, wait_status, write_rows

TOKEN = "outbound-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEAD = f"http://127.0.0.1:{free_port()}"  # allowed, but nothing listens: connections are refused


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    """`a` and `b` are under `--allow-url`; `other` is a live host nobody allowed."""
    with run_engine_in_thread(template="qwen2.5", seed=1, engine_id="a") as a, \
            run_engine_in_thread(template="qwen2.5", seed=2, engine_id="b") as b, \
            run_engine_in_thread(template="qwen2.5", seed=3, engine_id="other") as other:
        yield {"a": a, "b": b, "other": other}


@pytest.fixture(scope="module")
def server(engines: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    allowed = [engines["a"].url, engines["b"].url, DEAD]
    args = [arg for url in allowed for arg in ("--allow-url", url)]
    with ServerProcess(tmp_path_factory.mktemp("outbound"), "--task-dir", LEGACY_TASKS, "--task-dir", RUNTIME_TASKS,
                       "--task-dir", str(REPO / "tests" / "fixtures" / "tasks"), *args,
                       env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}) as proc:
        yield proc


@pytest.fixture()
def client(server: ServerProcess, engines: dict[str, Any]) -> Iterator[httpx.Client]:
    for engine in engines.values():
        engine.reset_stats()
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
        yield http


@pytest.fixture()
def elsewhere(tiny_server: Any) -> tuple[str, list[str]]:
    """A live host nobody allowed that records the path of every request it gets, whatever the route."""
    from aiohttp import web

    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    return tiny_server(app), seen


def reached(engine: Any) -> dict[str, int]:
    """Requests per endpoint path that reached `engine` since the test began."""
    return dict(engine.stats_dict()["endpoints"])


def legacy_body(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    rows = [{"instance_id": f"p{i}", "prompt": f"prompt {i}"} for i in range(3)]
    return {"task_type": "slime_style", "input_file": str(write_rows(tmp_path, rows, "legacy.jsonl")),
            "num_repeat_per_sample": "2", "num_epoch": "1", "num_process": "4", **extra}


def assert_refused(answer: httpx.Response, field: str, status: int = 403) -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["errors"][0]["field"] == field and "--allow-url" in body["message"], body


def test_an_engine_list_cannot_carry_a_host_nobody_allowed(client: httpx.Client, engines: dict[str, Any],
                                                           tmp_path: Path, qwen_tokenizer_path: str) -> None:
    a, other = engines["a"].url, engines["other"].url
    native = {"task_type": "math", "input_file": str(write_rows(tmp_path, arithmetic_rows(2))),
              "tokenizer_path": qwen_tokenizer_path, "num_process": "2"}
    for engine_list in (f"{a}/ {other}/", f"{a},{other}", f"{a}\n{other}", [f"{a}/x", f"{other}/y"],
                        [a, f" {other} "], f"{a}/ok/.., {a}"):
        for body in (native, legacy_body(tmp_path)):
            answer = client.post("/start_rollout", json={**body, "remote_engine_url": engine_list})
            assert_refused(answer, "remote_engine_url")
    assert client.get("/runs").json()["runs"] == [], "nothing stored"
    assert reached(engines["other"]) == {} and reached(engines["a"]) == {}, "nothing called"


def test_a_module_is_never_handed_a_buffer_url_nobody_allowed(client: httpx.Client, server: ServerProcess,
                                                              elsewhere: tuple[str, list[str]], tmp_path: Path) -> None:
    other, seen = elsewhere
    for url in (other, f"{other}/runs/x", f"http://127.0.0.1:{server.port}@{other.removeprefix('http://')}"):
        assert_refused(client.post("/start_rollout", json=legacy_body(tmp_path, remote_buffer_url=url)),
                       "remote_buffer_url")
    malformed = client.post("/start_rollout", json=legacy_body(tmp_path, remote_buffer_url="ftp://x/"))
    assert malformed.status_code == 400 and malformed.json()["errors"][0]["field"] == "remote_buffer_url"
    assert client.get("/runs").json()["runs"] == [], "nothing stored, nothing started"
    assert seen == [], "no write key left for the other host"


def test_without_a_buffer_url_the_module_writes_to_the_servers_own_socket_whatever_the_host_header(
        client: httpx.Client, server: ServerProcess, elsewhere: tuple[str, list[str]], tmp_path: Path) -> None:
    other, seen = elsewhere
    answer = client.post("/start_rollout", json=legacy_body(tmp_path, run_id="own-url"),
                         headers={"Host": other.removeprefix("http://")})
    assert answer.status_code == 200, answer.text
    detail = wait_status(client, "own-url", "finished")  # the module raises (run failed) if a write failed
    assert detail["records"]["written"] == 6
    assert detail["config"]["remote_buffer_url"] == server.url, "the socket's address, not the Host header"
    assert seen == [], "the write key went nowhere else"
    # slime's form: the buffer's own URL named explicitly is the server's own, allowed without a prefix
    again = client.post("/start_rollout", json=legacy_body(tmp_path, run_id="own-url-named",
                                                           remote_buffer_url=f"{server.url}/"))
    assert again.status_code == 200, again.text
    assert wait_status(client, "own-url-named", "finished")["records"]["written"] == 6


def test_abort_in_flight_aborts_every_engine_of_the_list_and_reports_each(
        client: httpx.Client, engines: dict[str, Any], tmp_path: Path) -> None:
    a, b = engines["a"].url, engines["b"].url
    body = legacy_body(tmp_path, task_type="external", run_id="two-engines", remote_engine_url=[a, f"{b}/"])
    assert client.post("/start_rollout", json=body).status_code == 200
    answer = client.post("/policy_version", json={"run_id": "two-engines", "version": 3, "abort_in_flight": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"]["engines"] == [{"url": f"{a}/abort_request", "aborted": True},
                                                {"url": f"{b}/abort_request", "aborted": True}]
    assert answer.json()["data"]["aborted"] is True
    for name in ("a", "b"):
        assert reached(engines[name]) == {"/abort_request": 1}, name
    assert reached(engines["other"]) == {}

    body = legacy_body(tmp_path, task_type="external", run_id="one-dead", remote_engine_url=f"{a} {DEAD}")
    assert client.post("/start_rollout", json=body).status_code == 200
    answer = client.post("/policy_version", json={"run_id": "one-dead", "version": 4, "abort_in_flight": True})
    assert answer.status_code == 502, answer.text
    assert "1 of 2 engine(s)" in answer.json()["message"]
    [live, dead] = answer.json()["data"]["engines"]
    assert live == {"url": f"{a}/abort_request", "aborted": True}
    assert dead["url"] == f"{DEAD}/abort_request" and not dead["aborted"] and DEAD in dead["error"]
    assert reached(engines["a"]) == {"/abort_request": 2}
    assert client.get("/runs/one-dead").json()["meta"]["policy_version"] == "4", "the version is set regardless"


def test_abort_in_flight_rechecks_the_engines_before_anything_changes(engines: dict[str, Any], tmp_path: Path) -> None:
    """A run started under a wider `--allow-url` than the server now has: its abort is refused by field."""
    a, b = engines["a"].url, engines["b"].url
    for engine in engines.values():
        engine.reset_stats()
    tasks = ("--task-dir", str(REPO / "tests" / "fixtures" / "tasks"))
    with ServerProcess(tmp_path / "data", *tasks, "--allow-url", a, "--allow-url", b) as wide, \
            httpx.Client(base_url=wide.url, timeout=30) as client:
        body = legacy_body(tmp_path, task_type="external", run_id="narrowed", remote_engine_url=[a, b])
        assert client.post("/start_rollout", json=body).status_code == 200
    with ServerProcess(tmp_path / "data", *tasks, "--allow-url", a) as narrow, \
            httpx.Client(base_url=narrow.url, timeout=30) as client:
        answer = client.post("/policy_version", json={"run_id": "narrowed", "version": 5, "abort_in_flight": True})
        assert_refused(answer, "remote_engine_url")
        assert b in answer.json()["message"]
        assert client.get("/runs/narrowed").json()["meta"].get("policy_version") != "5", "the version is unchanged"
    assert reached(engines["a"]) == {} and reached(engines["b"]) == {}, "no engine was called"


def test_outbound_units() -> None:
    policy = AccessPolicy(roots=(Path("/"),), allowed_urls=("http://e:1", "http://buf:2/b"))
    assert checked_engine_urls(policy, "http://e:1/, http://e:1/v1") == ("http://e:1", "http://e:1/v1")
    assert abort_targets(policy, ["http://e:1"]) == ("http://e:1/abort_request",)
    with pytest.raises(AccessDenied, match="--allow-url"):
        abort_targets(policy, "http://e:1 http://f:1")
    for bad, status in (("http://e:1 http://f:1", 403), ("http://e:1,ftp://e:1", 400), ("http://e:1/?q=1", 400)):
        with pytest.raises(AccessDenied) as denied:
            checked_engine_urls(policy, bad)
        assert (denied.value.field, denied.value.status_code) == ("remote_engine_url", status), bad
    own = "http://127.0.0.1:8889"
    assert buffer_url_for(policy, "", own) == own
    assert buffer_url_for(policy, f"{own}/", own) == own
    assert buffer_url_for(policy, "http://buf:2/b/", own) == "http://buf:2/b"
    for bad in ("http://buf:2/c", "http://other:2", f"{own}@other:1"):
        with pytest.raises(AccessDenied, match="--allow-url"):
            buffer_url_for(policy, bad, own)
    assert buffer_url_for(AccessPolicy(roots=(Path("/"),)), "http://any:1", own) == "http://any:1", "no prefix"
    assert own_base_url(("10.0.0.5", 8889), "http://ignored") == "http://10.0.0.5:8889"
    assert own_base_url(("::1", 8889), "http://ignored") == "http://[::1]:8889"
    assert own_base_url(None, "http://fallback:1/") == "http://fallback:1"


@pytest.mark.parametrize("redis_store", ["embedded"], indirect=True)
async def test_a_callback_outside_allow_url_is_recorded_failed_and_never_sent(
        redis_store: Store, elsewhere: tuple[str, list[str]]) -> None:
    other, seen = elsewhere
    states = RemoteStates(redis_store.redis)
    init = InitRequest(rollout_id="cb-1", server_url=other, messages=[{"role": "user", "content": "x"}],
                       tokenizer_name="t", task_type="remote_calculator")
    assert await states.claim(init, "owner-a")
    policy = AccessPolicy(roots=(Path("/"),), allowed_urls=("http://127.0.0.1:9",))
    async with aiohttp.ClientSession() as session:
        sender = CallbackSender(session, states, RemoteSettings(), "owner-a", access=policy)
        assert not await sender.deliver("cb-1", other, {"rollout_id": "cb-1"})
    state = await states.get("cb-1")
    assert state is not None and state["callback_status"] == "failed", state
    assert "--allow-url" in state["callback_error"] and seen == []


@pytest.mark.parametrize("redis_store", ["embedded"], indirect=True)
async def test_a_worker_serves_no_run_with_an_engine_outside_its_allow_url(redis_store: Store) -> None:
    """A run stored under a wider `--allow-url` (a restart with a narrower one): its workers do not call."""
    config = StartRolloutRequest(task_type="math", input_file="x", remote_engine_url="http://a:1 http://b:2",
                                 engine_api="chat").model_dump()
    await redis_store.create_run("w-run", config, group_size=1, num_epoch=1, task_type="math")
    registry = discover()
    wide = await load_handle(redis_store, registry, Settings(allow_url=["http://a:1", "http://b:2"]), "w-run")
    assert wide is not None and wide.options.engine_urls == ("http://a:1", "http://b:2")
    assert await load_handle(redis_store, registry, Settings(allow_url=["http://a:1"]), "w-run") is None


def test_the_worker_command_takes_allow_url_like_serve() -> None:
    """`rollout-buffer worker --allow-url` (not only ROLLOUT_BUFFER_ALLOW_URL) narrows the worker's calls."""
    from rollout_buffer.cli import build_parser, settings_from

    args = build_parser().parse_args(["worker", "--allow-url", "http://a:1", "--allow-url", "http://b:2/v1"])
    assert settings_from(args).allow_url == ["http://a:1", "http://b:2/v1"]
