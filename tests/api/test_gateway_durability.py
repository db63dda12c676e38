"""Gateway sessions are durable and exactly-once: an API process SIGKILLed mid-turn loses nothing that
was answered, the client's retry carries on without a duplicate turn, and a second API process on the
same Redis serves the same session."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.gateway import CALCULATOR, assert_one_branch, finish, new_session, read_group, start_external
from tests.support.helpers import ServerProcess
from tests.support.process_tools import wait_for


def test_killed_api_process_mid_turn_then_retry(tmp_path: Path, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir, "--session-timeout-s", "120").start()
    client = httpx.Client(base_url=server.url, timeout=30)
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "durable")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 25 * 4?"}]
    first = sdk.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "100"})
    rollout_engine.reset_stats()
    rollout_engine.configure(latency_s=3.0)
    failed: list[BaseException] = []

    def in_flight() -> None:
        try:
            sdk.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        except openai.APIError as exc:
            failed.append(exc)

    thread = threading.Thread(target=in_flight)
    try:
        thread.start()
        wait_for(lambda: rollout_engine.stats_dict()["in_flight"] >= 1, 15, "the second turn reached the engine")
        server.kill(signal.SIGKILL)
        thread.join(timeout=30)
        assert failed, "the client saw its request fail"
    finally:
        rollout_engine.configure(latency_s=0.0)
    restarted = ServerProcess(data_dir, "--session-timeout-s", "120")
    restarted.port = server.port
    with restarted:
        second = sdk.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])  # the retry
        again = sdk.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])  # answer lost: again
        assert again.id == second.id and again.choices[0].message == second.choices[0].message
        requests = rollout_engine.stats_dict()["requests"]
        assert requests == 2, "the killed attempt and the retry reached the engine; the repeat was replayed"
        with httpx.Client(base_url=restarted.url, timeout=30) as client2:
            stats = client2.get(f"/runs/{run_id}").json()["stats"]
            assert stats["gateway_turns"] == 2 and stats["gateway_replays"] == 1
            finish(client2, session, 1.0)
            [record] = read_group(client2, run_id, 1)
    assert len(record["turns"]) == 2, "no duplicate turn"
    assert_one_branch(record)
    assert record["messages"][-1]["content"] == (second.choices[0].message.content or "")


def test_a_session_moves_between_api_processes(tmp_path: Path, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    with ServerProcess(tmp_path / "a") as a:
        redis_url = f"unix://{(tmp_path / 'a' / 'redis.sock').resolve()}"
        with ServerProcess(tmp_path / "b", "--redis-url", redis_url) as b:
            run_id = start_external(httpx.Client(base_url=a.url, timeout=60), rollout_engine.url, qwen_tokenizer_path,
                                    repeats=1)
            session = new_session(httpx.Client(base_url=a.url, timeout=60), run_id, "roaming")
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 3 * 7?"}]
            for url in (a.url, b.url, a.url):
                sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=session["api_key"], max_retries=0)
                reply = sdk.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR]).choices[0]
                messages.append(reply.message.model_dump(exclude_none=True))
                for call in reply.message.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "21"})
                if not reply.message.tool_calls:
                    messages.append({"role": "user", "content": "And 21 + 1?"})
            finish(httpx.Client(base_url=b.url, timeout=60), session, 1.0)
            [record] = read_group(httpx.Client(base_url=a.url, timeout=30), run_id, 1)
            assert len(record["turns"]) == 3
            assert_one_branch(record)
            stats = httpx.get(f"{b.url}/runs/{run_id}", timeout=30).json()["stats"]
            assert "gateway_forks" not in stats


def test_a_restart_with_a_live_gateway_run_logs_no_error(tmp_path: Path, rollout_engine: Any,
                                                         qwen_tokenizer_path: str) -> None:
    """Workers skip an external run quietly (the gateway serves it): no `task_type 'external' is not known`."""
    data_dir = tmp_path / "data"
    with ServerProcess(data_dir) as first, httpx.Client(base_url=first.url, timeout=30) as client:
        run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "across-a-restart")
    with ServerProcess(data_dir, "--log-level", "debug") as second, \
            httpx.Client(base_url=second.url, timeout=30) as client:
        seen = f"run {run_id}: an external run, served by the gateway"
        wait_for(lambda: seen in second.log_path.read_text() or "is not known" in second.log_path.read_text(),
                 60, "the restarted workers looked at the run")
        finish(client, session, 1.0)
        [record] = read_group(client, run_id, 1)
        log = second.log_path.read_text()
    assert record["reward"] == 1.0, "the session carried on"
    assert "is not known to this worker" not in log and " ERROR " not in log, log[-3000:]
    assert seen in log
