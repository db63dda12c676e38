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
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus, urljoin, urlsplit

import httpx
import pytest

from rollout_buffer.cli import build_parser, settings_from, warn_if_exposed
from rollout_buffer.security.auth import (
    GATEWAY_PREFIXES,
    bearer_matches,
    capability,
    is_loopback,
    run_write_url,
    same_origin_path,
)
from rollout_buffer.security.redaction import redact, redact_record
from tests.support.helpers import REPO, ServerProcess, ServerSpec
from tests.support.process_tools import wait_for
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
    # the agent gateway's routes check a session's own key and answer in their API's shape
    # (tests/test_gateway_sessions.py)
    requests = [r for r in requests if r != ("GET", "/health") and not r[1].startswith(GATEWAY_PREFIXES)]
    requests += [("GET", path) for path in DOCS_AND_STATIC]
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
            if path.startswith("/v1/"):  # model endpoints take a session's key, which the token is not
                continue
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


def test_the_redirect_after_the_token_stays_on_this_server(server: ServerProcess) -> None:
    """`GET //evil.example?token=<token>` must not send the browser (now holding the cookie) to another site:
    whatever the path, Location is one path on this server, with nothing a browser reads as a host."""
    attacks = ["//evil.example", "//evil.example/x", "///evil.example", "/\\evil.example", "/\\/evil.example",
               "/%5Cevil.example", "/%2F%2Fevil.example", "/%2f/evil.example", "/http://evil.example",
               "/%09/evil.example", "/%0A/evil.example", "/%20//evil.example", "/@evil.example"]
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for path in attacks:
            client.cookies.clear()  # the cookie of the last answer would open the path without the token
            answer = client.get(f"{server.url}{path}?token={TOKEN}", follow_redirects=False)
            assert answer.status_code == 303, (path, answer.status_code)
            location = answer.headers["location"]
            assert location.startswith("/") and not location.startswith("//"), (path, location)
            assert not any(c in location for c in "\\\t\r\n "), (path, location)
            target = urlsplit(urljoin(f"{server.url}{path}", location))
            assert (target.scheme, target.netloc) == ("http", f"127.0.0.1:{server.port}"), (path, location)
            if path == "//evil.example":
                assert location == "/evil.example", location
        assert same_origin_path("/") == "/" and same_origin_path("/runs/a b") == "/runs/a%20b"


def test_redaction_units() -> None:
    key = "ab" * 32
    assert redact(f"GET /?run=r1&token={TOKEN} x") == "GET /?run=r1&token=<redacted> x"
    for name in ("%74oken", "to%6Ben", "%74%6F%6B%65%6E", "tok%65n"):
        assert unquote_plus(name) == "token"
        assert redact(f"/?{name}={TOKEN}") == f"/?{name}=<redacted>", name
    assert redact(f"/a%3Fb?x?token={TOKEN}&y=1") == "/a%3Fb?x?token=<redacted>&y=1", "a '?' hides no parameter"
    for name in ("TOKEN", "Token", "%54oken"):  # not accepted as the token, but its value is the secret all the same
        assert redact(f"/?{name}={TOKEN}") == f"/?{name}=<redacted>", name
    assert redact("/?tokens=1&xtoken=2") == "/?tokens=1&xtoken=2", "other parameters stay"
    once = redact(f'"GET /runs/r/cap/{key}/buffer/write?token={TOKEN}&a=1 HTTP/1.1" 200')
    assert once == '"GET /runs/r/cap/<redacted>/buffer/write?token=<redacted>&a=1 HTTP/1.1" 200' == redact(once)
    for url in (f"http://h:1/runs/r/cap/{key}/buffer/write", f"/runs/r/%63ap/{key}/buffer/write",
                f"/runs/r%2Fcap%2F{key}%2Fbuffer/write", f"/runs/r/CAP/{key}"):
        assert key not in redact(url) and "<redacted>" in redact(url), url
    record = logging.LogRecord("httpx", logging.INFO, __file__, 1, "HTTP Request: %s %s %d", None, None)
    record.args = ("POST", httpx.URL(f"http://h:1/runs/r/cap/{key}/buffer/write"), 200)
    redact_record(record)
    assert record.getMessage() == "HTTP Request: POST http://h:1/runs/r/cap/<redacted>/buffer/write 200"
    split = logging.LogRecord("x", logging.INFO, __file__, 1, "/runs/r/cap/%s/buffer/write", (key,), None)
    redact_record(split)
    assert key not in split.getMessage(), "a key that is an argument of a URL template"


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_token_and_write_keys_stay_out_of_the_server_log(tmp_path: Path, level: str) -> None:
    """A real server with `--auth-token-file`: the token, sent as `?token=` under any spelling of the name
    that authenticates, and a run's write key, in capability URLs posted by the test and by a task module's
    `requests`/`httpx` calls (which log URLs at DEBUG/INFO), appear nowhere in the server's output."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    encoded_value = "".join(f"%{byte:02X}" for byte in TOKEN.encode())
    queries = [f"run=r1&token={TOKEN}", f"%74oken={TOKEN}", f"to%6Ben={TOKEN}", f"%74%6F%6B%65%6E={TOKEN}",
               f"%74oken={encoded_value}", f"x=1?&token={TOKEN}"]
    rows = [{"instance_id": f"p{i}", "prompt": f"prompt {i}"} for i in range(2)]
    body = {"task_type": "slime_requests", "input_file": str(write_rows(tmp_path, rows)),
            "num_repeat_per_sample": "2", "num_epoch": "1", "num_process": "1"}
    with ServerProcess(tmp_path / "data", "--log-level", level, "--auth-token-file", str(token_file),
                       "--task-dir", LEGACY_TASKS) as proc, \
            httpx.Client(base_url=proc.url, timeout=30) as anonymous, \
            httpx.Client(base_url=proc.url, timeout=30, headers=AUTH) as owner:
        for query in queries:
            answer = anonymous.get(f"{proc.url}/?{query}", follow_redirects=False)
            assert answer.status_code == 303, (query, "the spelling authenticates, so it must be redacted")
            anonymous.cookies.clear()  # else this answer's cookie, not the next query, would open the page
        assert anonymous.get("/runs", params={"token": "wrong-guess"}).status_code == 401
        started = owner.post("/start_rollout", json=body)
        assert started.status_code == 200, started.text
        run_id = started.json()["run_id"]
        assert wait_status(owner, run_id, "finished")["records"]["written"] == 4, "the module wrote through its URL"
        key = capability(TOKEN, run_id)
        record = {"uid": "u-late", "instance_id": "late", "messages": [{"role": "user", "content": "q"}],
                  "reward": 1.0, "extra_info": {}}
        assert anonymous.post(f"/runs/{run_id}/cap/{key}/buffer/write", json=record).status_code == 200
        access = f'"POST /runs/{run_id}/cap/<redacted>/buffer/write HTTP/1.1" 200'
        wait_for(lambda: proc.log_path.read_text().count(access) >= 5, 15, "the five writes' access log lines")
    log = proc.log_path.read_text()
    assert TOKEN not in log and encoded_value not in log and key not in log and "wrong-guess" not in log, log[-3000:]
    assert "Logging error" not in log, "every redacted record still formats"
    assert '"GET /?%74oken=<redacted> HTTP/1.1" 303' in log and "/runs?token=<redacted>" in log
    assert f"httpx: HTTP Request: POST {proc.url}/runs/{run_id}/cap/<redacted>/buffer/write" in log
    urllib3_line = f'urllib3.connectionpool: {proc.url} "POST /runs/{run_id}/cap/<redacted>/buffer/write'
    assert (urllib3_line in log) is (level == "debug"), "urllib3 logs the URL at DEBUG only"
