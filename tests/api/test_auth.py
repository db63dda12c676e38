"""Bearer-token authentication: with a token set, no route but /health answers anything without it (every
route of the OpenAPI schema, the docs and static routes, unknown paths); slime-style modules write through
their per-run capability URL, which opens nothing else; the token comes from a flag, the environment or a
file; serving beyond loopback without one warns loudly."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.cli import build_parser, settings_from, warn_if_exposed
from rollout_buffer.security.auth import bearer_matches, capability, is_loopback, run_write_url
from tests.support.helpers import REPO, ServerProcess, ServerSpec
from tests.support.runtime_helpers import LEGACY_TASKS, wait_status, write_rows

TOKEN = "s3cret-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOCS_AND_STATIC = ["/docs", "/docs/oauth2-redirect", "/openapi.json", "/static/docs/swagger-ui.css",
                   "/static/docs/swagger-ui-bundle.js", "/static/docs/favicon.png", "/no/such/route"]


SERVER = ServerSpec(args=("--task-dir", LEGACY_TASKS), env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN})


def schema_requests(server: ServerProcess) -> list[tuple[str, str]]:
    """(method, concrete path) of every operation in the OpenAPI schema, path parameters filled in."""
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    requests = []
    for path, operations in schema["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        for method in operations:
            requests.append((method.upper(), concrete))
    return requests


def test_every_route_but_health_refuses_a_request_without_the_token(server: ServerProcess) -> None:
    requests = schema_requests(server)
    paths = {path for _, path in requests}
    assert {"/start_rollout", "/buffer/write", "/get_rollout_data", "/runs/x", "/ack", "/init", "/tasks",
            "/metrics", "/buffer/write_packed", "/runs/x/buffer/write"} <= paths, paths
    assert ("GET", "/health") in requests
    requests = [r for r in requests if r != ("GET", "/health")] + [("GET", path) for path in DOCS_AND_STATIC]
    requests += [("POST", f"/runs/x/cap/{'0' * 64}/buffer/write")]  # a capability URL with a wrong key
    bad_headers: list[dict[str, str]] = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                         {"Authorization": f"Basic {TOKEN}"},
                                         {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer"}]
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for method, path in requests:
            for headers in bad_headers:
                answer = client.request(method, path, headers=headers, json={"x": 1})
                assert answer.status_code == 401, (method, path, headers, answer.status_code, answer.text[:200])
                assert answer.headers["www-authenticate"] == "Bearer"
                assert set(answer.json()) == {"success", "message"}, "a refusal carries no data"
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", "/health stays open"


def test_the_token_opens_every_route(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10, headers=AUTH) as client:
        for method, path in schema_requests(server):
            answer = client.request(method, path, json={})
            assert answer.status_code not in (401, 403) and answer.status_code < 500, (method, path, answer.text)
        for path in DOCS_AND_STATIC[:-1]:
            assert client.get(path).status_code == 200, path
        assert client.get("/runs").json()["runs"] == []
        lower = client.get("/runs", headers={"Authorization": f"bearer {TOKEN}"})
        assert lower.status_code == 200, "the scheme name is case-insensitive (RFC 7235)"


def test_a_legacy_module_writes_through_its_capability_url_only(server: ServerProcess, tmp_path: Path) -> None:
    rows = [{"instance_id": f"p{i}", "prompt": f"prompt {i}"} for i in range(4)]
    body = {"task_type": "slime_style", "input_file": str(write_rows(tmp_path, rows)), "num_repeat_per_sample": "2",
            "num_epoch": "1", "num_process": "4", "run_id": "legacy-with-token"}
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as client:
        started = client.post("/start_rollout", json=body)
        assert started.status_code == 200, started.text
        run_id = started.json()["run_id"]
        detail = wait_status(client, run_id, "finished")  # the module raises (run failed) if a write was refused
        assert detail["records"]["written"] == 8
        data = client.post("/get_rollout_data", json={"run_id": run_id}).json()
        assert sorted({r["instance_id"] for r in data["data"]["data"]}) == [f"p{i}" for i in range(4)]

        key = capability(TOKEN, run_id)
        record = {"uid": "u-cap", "instance_id": "late-writer", "messages": [{"role": "user", "content": "q"}],
                  "reward": 1.0, "extra_info": {}}
        anonymous = httpx.Client(base_url=server.url, timeout=10)
        write = anonymous.post(f"/runs/{run_id}/cap/{key}/buffer/write", json=record)
        assert write.status_code == 200 and write.json()["data"]["run_id"] == run_id, write.text
        assert anonymous.post(f"/runs/other-run/cap/{key}/buffer/write", json=record).status_code == 401, \
            "a run's key opens no other run"
        assert anonymous.get(f"/runs/{run_id}/cap/{key}/buffer/write").status_code == 401, "only POST"
        for path in (f"/runs/{run_id}/cap/{key}", f"/runs/{run_id}/cap/{key}/buffer/write_batch",
                     f"/runs/{run_id}/cap/{key}/../../runs", f"/runs/{run_id}"):
            assert anonymous.request("GET", path).status_code == 401, path
        assert anonymous.post("/get_rollout_data", json={"run_id": run_id}).status_code == 401


def test_capability_url_and_bearer_check_units() -> None:
    assert run_write_url("http://h:1/", "r1", None) == "http://h:1/runs/r1"
    assert run_write_url("http://h:1", "r1", "t") == f"http://h:1/runs/r1/cap/{capability('t', 'r1')}"
    assert capability("t", "r1") != capability("t", "r2") != capability("u", "r2")
    assert bearer_matches(b"Bearer tok", b"tok") and bearer_matches(b"BEARER  tok ", b"tok")
    for header in (None, b"", b"Bearer", b"Bearer to", b"Bearer tokk", b"tok", b"Basic tok"):
        assert not bearer_matches(header, b"tok"), header


def test_token_file_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\nignored second line\n")
    monkeypatch.setenv("ROLLOUT_BUFFER_AUTH_TOKEN", "from-the-environment")
    parse = build_parser().parse_args
    assert settings_from(parse(["serve", "--auth-token-file", str(token_file)])).resolved_auth_token() == TOKEN, \
        "a flag wins over the other source's environment variable"
    assert settings_from(parse(["serve"])).resolved_auth_token() == "from-the-environment"
    assert settings_from(parse(["serve", "--auth-token", "flag"])).resolved_auth_token() == "flag"
    monkeypatch.delenv("ROLLOUT_BUFFER_AUTH_TOKEN")
    assert settings_from(parse(["serve"])).resolved_auth_token() is None


def test_server_with_a_token_file_and_an_empty_one(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerProcess(tmp_path / "data", "--auth-token-file", str(token_file)) as server:
        assert httpx.get(f"{server.url}/runs", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/runs", headers=AUTH, timeout=10).status_code == 200
    empty = tmp_path / "empty"
    empty.write_text("\n")
    server = ServerProcess(tmp_path / "data2", "--auth-token-file", str(empty))
    with pytest.raises(RuntimeError, match="is empty"):
        server.start(timeout_s=30)


@pytest.mark.parametrize(("host", "token", "warned"), [
    ("0.0.0.0", None, True), ("10.1.2.3", None, True), ("::", None, True), ("node17", None, True),
    ("0.0.0.0", "t", False), ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False)])
def test_serving_beyond_loopback_without_a_token_warns(host: str, token: str | None, warned: bool,
                                                        caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_BUFFER_AUTH_TOKEN", raising=False)
    argv = ["serve", "--host", host] + (["--auth-token", token] if token else [])
    with caplog.at_level(logging.WARNING):
        assert warn_if_exposed(settings_from(build_parser().parse_args(argv))) is warned
    assert ("WITHOUT AN AUTH TOKEN" in caplog.text) is warned
    assert is_loopback(host) is (host in ("127.0.0.1", "localhost", "::1"))


def test_a_real_server_on_all_interfaces_logs_the_warning(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", "--host", "0.0.0.0")
    with server:
        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code == 200
    text = server.log_path.read_text()
    assert "WITHOUT AN AUTH TOKEN" in text and "Running on a network" in text
    quiet = ServerProcess(tmp_path / "data-quiet")
    with quiet:
        pass
    assert "WITHOUT AN AUTH TOKEN" not in quiet.log_path.read_text()


def test_a_browser_opens_the_dashboard_with_the_token_once(server: ServerProcess) -> None:
    """`/?token=` answers 303 without the token in the URL and sets an HttpOnly cookie that is not the token;
    the cookie opens GET routes only, so it cannot start, write or consume anything."""
    with httpx.Client(base_url=server.url, timeout=10) as client:
        answer = client.get("/", params={"token": TOKEN, "run": "math-1"}, follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == "/?run=math-1"
        set_cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and TOKEN not in set_cookie
        cookie = client.cookies.get("rollout_buffer_token")
        assert cookie, set_cookie
        assert client.get("/").status_code == 200 and client.get("/api/dashboard").status_code == 200
        assert client.get("/runs").status_code == 200
        for method, path in [("POST", "/start_rollout"), ("POST", "/get_rollout_data"), ("POST", "/buffer/write"),
                             ("DELETE", "/runs/x"), ("POST", "/ack"), ("POST", "/policy_version")]:
            assert client.request(method, path, json={}).status_code == 401, (method, path)
    with httpx.Client(base_url=server.url, timeout=10) as stranger:
        assert stranger.get("/", params={"token": TOKEN + "x"}, follow_redirects=False).status_code == 401
        stranger.cookies.set("rollout_buffer_token", TOKEN)
        assert stranger.get("/api/dashboard").status_code == 401, "the raw token is not the cookie"
        stranger.cookies.set("rollout_buffer_token", cookie[:-1] + ("0" if cookie[-1] != "0" else "1"))
        assert stranger.get("/api/dashboard").status_code == 401


def test_the_dashboard_page_loads_its_data_in_an_offline_browser_with_the_token(
        server: ServerProcess, offline_browser: Any) -> None:
    visit = offline_browser.open(f"{server.url}/?token={TOKEN}&refresh=0.5", wait_for="body[data-updates]",
                                 wait_until="load")
    assert "token" not in visit.page.url, "the token leaves the address bar"
    assert int(visit.page.get_attribute("body", "data-updates") or 0) >= 1
    assert visit.outside_requests() == [] and visit.page_errors == []
    visit.page.context.clear_cookies()
    blocked = offline_browser.open(f"{server.url}/", wait_for="body", wait_until="load")
    assert "open /?token=<token> once" in blocked.page.locator("body").inner_text(), "the refusal says what to do"


def test_status_sends_the_token_from_the_environment(server: ServerProcess, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "rollout_buffer.cli", "status", "--url", server.url]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUFFER_AUTH")}
    refused = subprocess.run(command, cwd=REPO, env=base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "401" in refused.stderr + refused.stdout
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for extra in ({"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}, {"ROLLOUT_BUFFER_AUTH_TOKEN_FILE": str(token_file)}):
        done = subprocess.run(command, cwd=REPO, env={**base, **extra, "COLUMNS": "200"}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "rollout-buffer v" in done.stdout and server.url in done.stdout


def test_the_token_in_a_dashboard_url_stays_out_of_the_access_log(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", "--log-level", "info", env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}) as proc:
        answer = httpx.get(f"{proc.url}/", params={"run": "r1", "token": TOKEN}, follow_redirects=False, timeout=10)
        assert answer.status_code == 303
        httpx.get(f"{proc.url}/runs", params={"token": "wrong-guess"}, timeout=10)
        deadline = time.monotonic() + 10
        while "token=<redacted>" not in proc.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = proc.log_path.read_text()
    assert '"GET /?run=r1&token=<redacted> HTTP/1.1" 303' in log, log[-2000:]
    assert "/runs?token=<redacted>" in log and TOKEN not in log and "wrong-guess" not in log
