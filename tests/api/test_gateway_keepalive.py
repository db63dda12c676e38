"""Streamed answers keep their clients alive: a generation slower than the client's read timeout reaches it
(the gateway's stream starts after a short grace, with keep-alive comments until the first tokens), a
failure after the stream started arrives as an error event in the API's own stream shape, and a client
that leaves before its first token aborts the generation."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from tests.support.gateway import engine_calls_of, new_session, start_external
from tests.support.helpers import ServerProcess, ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))
READ_TIMEOUT = httpx.Timeout(60, read=6.5)  # the engine takes 8 s; the gateway's keep-alives come every 5 s


def test_a_generation_slower_than_the_read_timeout_reaches_streamed_clients(server: ServerProcess,
                                                                            qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=4, latency_s=8.0) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "slow")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0,
                            timeout=READ_TIMEOUT)
        with sdk.chat.completions.stream(model="m", messages=[{"role": "user", "content": "What is 2 + 5?"}]) as events:
            completion = events.get_final_completion()
        assert "\\boxed{" in completion.choices[0].message.content
        claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                     max_retries=0, timeout=anthropic.Timeout(60, read=6.5))
        with claude.messages.stream(model="m", max_tokens=200,
                                    messages=[{"role": "user", "content": "What is 3 + 5?"}]) as stream:
            reply = stream.get_final_message()
        assert reply.stop_reason == "end_turn" and "\\boxed{" in reply.content[-1].text
        assert len(engine_calls_of(engine, session["session_id"])) == 2


def test_a_failure_after_the_stream_started_is_an_error_event(server: ServerProcess, qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=4) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1, engine_retries=2,
                                engine_backoff_s=0.5)
        session = new_session(client, run_id, "failing")
        engine.configure(fail_next=100)  # every attempt fails: after its retries the gateway is past its grace
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        with pytest.raises(openai.APIError) as caught:
            with sdk.chat.completions.stream(model="m", messages=[{"role": "user", "content": "Hi"}]) as events:
                list(events)
        assert "busy or unreachable" in str(caught.value)
        claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as refused:
            with claude.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]) as s:
                s.get_final_message()
        assert "busy or unreachable" in str(refused.value)
        engine.configure(fail_next=0)


def test_a_client_that_goes_away_before_the_first_token_aborts_and_its_retry_is_answered_afresh(
        server: ServerProcess, qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=4, latency_s=2.0) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "gone")
        body = {"model": "m", "messages": [{"role": "user", "content": "What is 4 + 4?"}]}
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", json={**body, "stream": True},
                          headers=headers, timeout=30) as response:
            assert response.status_code == 200  # the stream started before the answer: the client leaves
        for _ in range(100):
            if engine_calls_of(engine, session["session_id"]):
                break
            time.sleep(0.05)
        [aborted] = engine_calls_of(engine, session["session_id"])  # in its prefill: aborted at the engine
        assert aborted["finish_reason"]["type"] == "abort" and aborted["output_ids"] == []
        engine.configure(latency_s=0.0)
        retried = httpx.post(f"{session['openai_base_url']}/chat/completions", json=body, headers=headers, timeout=30)
        assert retried.status_code == 200 and "\\boxed{" in retried.json()["choices"][0]["message"]["content"]
        stats = client.get(f"/runs/{run_id}").json()["stats"]
        assert stats["gateway_turns"] == 1 and stats["gateway_streams_aborted"] == 1 and "gateway_replays" not in stats
        assert len(engine_calls_of(engine, session["session_id"])) == 2
