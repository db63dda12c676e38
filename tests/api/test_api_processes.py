"""`serve --api-processes N`: real processes on one loopback port. Each request is sent to the API process
the test chooses (tests/support/connections.py finds which process accepted a connection), so a gateway
conversation's turns alternate between processes and must stay token-exact; `/metrics` from any process sums
every process's counters; SIGTERM leaves no process behind, a killed parent neither, and a dead API process
is replaced."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_buffer.settings import Settings
from tests.support.connections import accepted_by, connection_to
from tests.support.gateway import (CALCULATOR, assert_one_branch, assert_turns_are_engine_calls, calculate,
                                   engine_calls_of, finish, new_session, read_group, start_external)
from tests.support.helpers import ServerProcess
from tests.support.process_tools import alive, children, wait_for, worker_children

API_MARK = "rollout_buffer.api.processes"
TWO = ("--api-processes", "2")


def api_pids(server: ServerProcess, count: int = 2, exclude: tuple[int, ...] = ()) -> list[int]:
    assert server.proc is not None

    def running() -> list[int] | None:
        pids = [p for p in children(server.proc.pid, API_MARK) if p not in exclude]
        return pids if len(pids) == count else None

    return wait_for(running, 60, f"{count} API processes")


def send(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None,
         token: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def scrape(server: ServerProcess, pid: int, pids: list[int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as answered by process `pid`: (sample name, labels) -> value."""
    conn = connection_to(server.port, pid, pids)
    try:
        status, body = send(conn, "GET", "/metrics")
    finally:
        conn.close()
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_a_conversation_across_api_processes_is_token_exact(tmp_path: Path, rollout_engine: Any,
                                                             qwen_tokenizer_path: str) -> None:
    with ServerProcess(tmp_path / "data", *TWO) as server:
        pids = api_pids(server)
        client = httpx.Client(base_url=server.url, timeout=60)
        run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "across")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 12 * 7?"}]
        served = []
        for turn in range(4):
            conn = connection_to(server.port, pids[turn % 2], pids)
            try:
                status, body = send(conn, "POST", "/v1/chat/completions",
                                    {"model": "m", "messages": messages, "tools": [CALCULATOR]}, session["api_key"])
                served.append(accepted_by(conn, pids))
            finally:
                conn.close()
            assert status == 200, body
            message = {k: v for k, v in json.loads(body)["choices"][0]["message"].items() if v is not None}
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": calculate(call["function"]["arguments"])})
            if not message.get("tool_calls"):
                messages.append({"role": "user", "content": f"Now add {turn + 2}."})
        assert served == [pids[0], pids[1], pids[0], pids[1]], "the turns alternated between the two processes"
        finish(client, session, 1.0)
        [record] = read_group(client, run_id, 1)
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
        assert_one_branch(record)
        for pid in pids:  # either process counts the turns both served
            assert scrape(server, pid, pids)[("rollout_buffer_gateway_turns_total", (("run_id", run_id),))] == 4


def test_metrics_sum_every_api_process(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", *TWO) as server:
        pids = api_pids(server)
        key = ("rollout_buffer_api_requests_total", ())
        before = scrape(server, pids[0], pids)[key]
        for i in range(10):
            conn = connection_to(server.port, pids[i % 2], pids)
            try:
                assert send(conn, "GET", "/health")[0] == 200
            finally:
                conn.close()
        after = scrape(server, pids[1], pids)[key]
        assert after - before == 11, "five requests on each process, and the second scrape itself"


def test_sigterm_stops_every_process(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", *TWO, "--worker-processes", "1").start()
    assert server.proc is not None
    pids = api_pids(server)
    workers = wait_for(lambda: worker_children(server.proc.pid), 30, "the worker process")
    redis = children(server.proc.pid, "redis-server")
    assert len(redis) == 1, "the parent started the embedded Redis, once"
    everything = pids + workers + redis
    assert server.stop() == 0
    wait_for(lambda: not any(alive(p) for p in everything), 30, "every process gone")


def test_a_dead_api_process_is_replaced_and_a_killed_parent_leaves_nothing(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", *TWO, "--worker-processes", "1").start()
    assert server.proc is not None
    first = api_pids(server)
    workers = wait_for(lambda: worker_children(server.proc.pid), 30, "the worker process")
    os.kill(first[0], signal.SIGKILL)
    [replacement] = api_pids(server, 1, exclude=(first[1],) + (first[0],))
    now = [first[1], replacement]
    conn = connection_to(server.port, replacement, now)
    try:
        assert send(conn, "GET", "/health")[0] == 200, "the replacement serves"
    finally:
        conn.close()
    everything = now + workers + children(server.proc.pid, "redis-server")
    server.kill(signal.SIGKILL)
    wait_for(lambda: not any(alive(p) for p in everything), 30,
             "the API processes, the worker and Redis died with the parent")


def test_the_default_is_one_api_process_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_BUFFER_API_PROCESSES", raising=False)
    assert Settings().api_processes == min(len(os.sched_getaffinity(0)), 8)
    monkeypatch.setenv("ROLLOUT_BUFFER_API_PROCESSES", "3")
    assert Settings().api_processes == 3
    usage = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "serve", "--help"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "--api-processes" in usage and "one per core, at most 8" in " ".join(usage.split())


def test_child_processes_get_the_token_itself_not_its_mask() -> None:
    """API and worker processes are told their settings as JSON, where a secret prints as '**********'."""
    from rollout_buffer.api.processes import child_overrides
    from rollout_buffer.runtime.supervisor import child_settings

    settings = Settings(auth_token="the-token", api_processes=3, worker_processes=2, workers=4)
    told = Settings(**{**child_settings(settings, None), **child_overrides(settings)})
    assert told.resolved_auth_token() == "the-token"
    assert (told.api_processes, told.worker_processes, told.workers) == (1, 0, 0), "the API only"
    alone = Settings(api_processes=2, worker_processes=0, workers=3)
    assert child_overrides(alone)["workers"] == 3, "--worker-processes 0: the loops stay in an API process"
