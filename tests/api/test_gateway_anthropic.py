"""The agent gateway with the real Anthropic SDK: tool loops (streamed and plain) produce token-exact
grouped records the adapter reads; the stream is Anthropic's full event sequence."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from slime_adapter.samples.build import build_group_samples
from tests.support.gateway import (
    CALCULATOR,
    anthropic_tool_loop,
    assert_one_branch,
    assert_turns_are_engine_calls,
    engine_calls_of,
    finish,
    new_session,
    read_group,
    start_external,
)
from tests.support.helpers import ServerSpec

QUESTIONS = ["What is 12 * 12 - 7?", "Now what is 81 / 9 + 1?"]


SERVER = ServerSpec(args=("--session-timeout-s", "60"))



@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_anthropic_tool_loops_make_token_exact_grouped_records(client: httpx.Client, rollout_engine: Any,
                                                               qwen_tokenizer_path: str, stream: bool) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=2)
    sessions = []
    for reward in (1.0, 0.5):
        session = new_session(client, run_id, "claude-1")
        sdk = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
        seen: list[list[str]] = []
        messages = anthropic_tool_loop(sdk, QUESTIONS, stream=stream, event_types=seen)
        assert sum(1 for m in messages if m["role"] == "assistant") >= 4, messages
        assert messages[1]["content"][-1]["type"] == "tool_use" and messages[1]["content"][-1]["name"] == "calculator"
        if stream:
            tool_call = seen[0]
            assert tool_call[0] == "message_start" and tool_call[-2:] == ["message_delta", "message_stop"]
            assert tool_call.count("content_block_start") == tool_call.count("content_block_stop") >= 1
            assert "input_json" in tool_call and "text" in seen[1]
        sessions.append(session)
        finish(client, session, reward)
    records = read_group(client, run_id, 2)
    for session in sessions:
        record = next(r for r in records if r["uid"] == session["session_id"])
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
        assert_one_branch(record)
        assert record["messages"][0] == {"role": "system", "content": "You are a careful calculator."}
        assert record["tools"] == [{"type": "function", "function": {
            "name": "calculator", "parameters": CALCULATOR["function"]["parameters"],
            "description": CALCULATOR["function"]["description"]}}]
        roles = [m["role"] for m in record["messages"]]
        assert roles[:5] == ["system", "user", "assistant", "tool", "assistant"], roles
    samples, stats = build_group_samples(records, lambda: pytest.fail("the token path needs no tokenizer"))
    assert stats.token_path_records == 2 and stats.forks == 0 and len(samples) == 2


def test_anthropic_answer_shape(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "shape")
    sdk = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    reply = sdk.messages.create(model="claude-policy", max_tokens=100,
                                messages=[{"role": "user", "content": "What is 6 + 7?"}])
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "claude-policy"
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == ["text"]
    [call] = engine_calls_of(rollout_engine, session["session_id"])
    assert reply.usage.input_tokens == len(call["prompt_ids"])
    assert reply.usage.output_tokens == len(call["output_ids"])
    [listed] = sdk.models.list().data
    assert listed.id == "default" and listed.type == "model"
    cut = sdk.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "What is 1 + 8?"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    for bad, param in (({"max_tokens": 10, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                       ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                       ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                        "messages.0.content.0")):
        answer = httpx.post(f"{session['anthropic_base_url']}/v1/messages", json={"model": "m", **bad},
                            headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"}, timeout=30)
        assert answer.status_code == 400, answer.text
        body = answer.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert param in body["error"]["message"]
