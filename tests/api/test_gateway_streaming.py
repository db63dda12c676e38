"""True streaming through the gateway with the real SDKs: the engine streams `/generate` and the gateway
forwards each delta as it arrives (text, reasoning, tool calls once their markup closes), the stored turn
is the engine's whole generation token for token, and a client that disconnects mid-stream aborts its
generation at the engine (`/abort_request`), nothing stored, its retry answered afresh."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.gateway import (
    ANTHROPIC_CALCULATOR,
    CALCULATOR,
    anthropic_tool_loop,
    assert_turns_are_engine_calls,
    engine_calls_of,
    finish,
    new_session,
    read_group,
    start_external,
)
from tests.support.helpers import ServerProcess, ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))
QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]


def _stats(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return client.get(f"/runs/{run_id}").json()["stats"]


def _record(client: httpx.Client, run_id: str, session: dict[str, Any]) -> dict[str, Any]:
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    return record


@pytest.fixture
def paced_engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen2.5", seed=5, token_delay_s=0.03) as engine:
        yield engine


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_chat_deltas_arrive_as_the_engine_generates_and_the_turn_is_token_exact(
        server: ServerProcess, qwen_tokenizer_path: str, paced_engine: Any, incremental: bool) -> None:
    paced_engine.configure(incremental_streaming_output=incremental, stream_interval=1)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, paced_engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "paced")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        started = time.monotonic()
        arrivals: list[tuple[float, str]] = []
        for chunk in sdk.chat.completions.create(model="m", messages=QUESTION, stream=True,
                                                 stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append((time.monotonic() - started, chunk.choices[0].delta.content))
            if chunk.usage is not None:
                usage = chunk.usage
        ended = time.monotonic() - started
        streamed = "".join(text for _, text in arrivals)
        assert len(arrivals) > 5 and ended - arrivals[0][0] > 0.3, arrivals  # deltas while it generates
        again = sdk.chat.completions.create(model="m", messages=QUESTION)  # the same request: the stored turn
        assert again.choices[0].message.content == streamed and "\\boxed{" in streamed
        assert usage.completion_tokens == again.usage.completion_tokens
        record = _record(client, run_id, session)
        assert_turns_are_engine_calls(record, engine_calls_of(paced_engine, session["session_id"]))
        assert _stats(client, run_id)["gateway_replays"] == 1


@pytest.fixture
def thinking_engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen3", seed=11, token_delay_s=0.04) as engine:
        yield engine


def test_thinking_and_tool_calls_stream_in_each_api_shape(server: ServerProcess, thinking_engine: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, thinking_engine.url, str(qwen_tokenizer_dir("qwen3")), repeats=1,
                                reasoning_parser="qwen3")
        session = new_session(client, run_id, "claude")
        claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                     max_retries=0)
        kinds: list[list[str]] = []
        messages = anthropic_tool_loop(claude, ["What is 17 * 23?"], stream=True, event_types=kinds)
        assert any(b["type"] == "tool_use" for m in messages for b in m["content"] if isinstance(b, dict))
        first = messages[1]["content"]
        assert first[0]["type"] == "thinking" and first[0]["signature"]
        assert kinds[0].count("content_block_delta") > 3  # thinking arrives in pieces
        again = claude.messages.create(model="policy", max_tokens=200, system="You are a careful calculator.",
                                       messages=messages[:1], tools=[ANTHROPIC_CALCULATOR])
        assert [b.model_dump(exclude_none=True) for b in again.content] == first  # the stored turn, the same blocks
        record = _record(client, run_id, session)
        assert_turns_are_engine_calls(record, engine_calls_of(thinking_engine, session["session_id"]))

        session = new_session(client, run_id, "responses")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        tool = {"type": "function", "name": "calculator", "description": CALCULATOR["function"]["description"],
                "parameters": CALCULATOR["function"]["parameters"]}
        with sdk.responses.stream(model="m", input="What is 19 * 21?", tools=[tool]) as stream:
            seen = [event.type for event in stream]
            final = stream.get_final_response()
        assert seen.count("response.reasoning_summary_text.delta") > 1
        assert "response.function_call_arguments.done" in seen and seen[-1] == "response.completed"
        plain = sdk.responses.create(model="m", input="What is 19 * 21?", tools=[tool])
        streamed = [{k: v for k, v in item.items() if k != "parsed_arguments"}  # the SDK's stream helper adds it
                    for item in final.model_dump()["output"]]
        assert plain.model_dump()["output"] == streamed
        record = _record(client, run_id, session)
        assert_turns_are_engine_calls(record, engine_calls_of(thinking_engine, session["session_id"]))


def test_a_client_that_disconnects_mid_stream_aborts_its_generation(server: ServerProcess,
                                                                    qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=5, token_delay_s=0.1) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "leaver")
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        body = {"model": "m", "messages": QUESTION}
        with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", json={**body, "stream": True},
                          headers=headers, timeout=30) as response:
            lines = response.iter_lines()
            assert any('"content":"' in line and '"content":""' not in line for line in lines)
        deadline = time.monotonic() + 10  # the client is gone after its first words
        while not engine_calls_of(engine, session["session_id"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        [aborted] = engine_calls_of(engine, session["session_id"])
        assert aborted["finish_reason"] == {"type": "abort", "message": "Abort requested by /abort_request"}
        while _stats(client, run_id).get("gateway_streams_aborted") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stats(client, run_id)["gateway_streams_aborted"] == 1
        engine.configure(token_delay_s=0.0)
        retried = httpx.post(f"{session['openai_base_url']}/chat/completions", json=body, headers=headers, timeout=30)
        assert retried.status_code == 200 and "\\boxed{" in retried.json()["choices"][0]["message"]["content"]
        calls = engine_calls_of(engine, session["session_id"])
        assert len(calls) == 2 and calls[1]["finish_reason"]["type"] != "abort"  # answered afresh
        record = _record(client, run_id, session)
        assert_turns_are_engine_calls(record, calls[1:])  # the aborted generation stored nothing
        stats = _stats(client, run_id)
        assert stats["gateway_turns"] == 1 and stats["gateway_streams_aborted"] == 1


def test_a_client_that_leaves_after_its_turn_was_stored_gets_it_replayed(server: ServerProcess,
                                                                         qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=5) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "late-leaver")
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        body = {"model": "m", "messages": QUESTION}
        with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", json={**body, "stream": True},
                          headers=headers, timeout=30) as response:
            for line in response.iter_lines():  # the finish chunk comes once the turn is stored: leave there
                if '"finish_reason":"stop"' in line:
                    break
        retried = httpx.post(f"{session['openai_base_url']}/chat/completions", json=body, headers=headers, timeout=30)
        assert retried.status_code == 200 and "\\boxed{" in retried.json()["choices"][0]["message"]["content"]
        stats = _stats(client, run_id)
        assert stats["gateway_replays"] == 1 and "gateway_streams_aborted" not in stats
        assert len(engine_calls_of(engine, session["session_id"])) == 1
