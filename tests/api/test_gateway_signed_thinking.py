"""Signed reasoning through the gateway with the real SDKs and a thinking model (Qwen3 template): thinking
blocks carry a signature and Responses reasoning items an `encrypted_content` (asked for with `include`);
echoed unchanged they continue the session, changed they are a counted fork (`edited`)."""

from __future__ import annotations

import json
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
    assert_one_branch,
    assert_turns_are_engine_calls,
    calculate,
    engine_calls_of,
    finish,
    new_session,
    read_group,
    start_external,
)
from tests.support.helpers import ServerProcess, ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))
TOOL = {"type": "function", "name": "calculator", "description": CALCULATOR["function"]["description"],
        "parameters": CALCULATOR["function"]["parameters"]}


@pytest.fixture(scope="module")
def thinking_engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen3", seed=11) as engine:
        yield engine


@pytest.fixture
def thinking_run(server: ServerProcess, thinking_engine: Any) -> Iterator[tuple[httpx.Client, str]]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client, start_external(client, thinking_engine.url, str(qwen_tokenizer_dir("qwen3")), repeats=1,
                                     reasoning_parser="qwen3")


def replay_like_pydantic_ai(content: list[Any]) -> list[dict[str, Any]]:
    """pydantic-ai's mapping of a reply for the next request: thinking goes back as a thinking block only
    when it is signed, otherwise as text in `<think>` tags."""
    out: list[dict[str, Any]] = []
    for block in content:
        if block.type == "thinking" and not block.signature:
            out.append({"type": "text", "text": f"<think>\n{block.thinking}\n</think>"})
        else:
            out.append(block.model_dump(exclude_none=True))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_loop_replaying_only_signed_thinking_makes_no_fork(thinking_run: tuple[httpx.Client, str],
                                                             thinking_engine: Any, stream: bool) -> None:
    client, run_id = thinking_run
    session = new_session(client, run_id, "pydantic-ai")
    sdk = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 17 * 3?"}]
    replies = []
    for _ in range(3):
        kwargs = {"model": "policy", "max_tokens": 400, "messages": messages, "tools": [ANTHROPIC_CALCULATOR]}
        if stream:
            with sdk.messages.stream(**kwargs) as events:
                reply = events.get_final_message()
        else:
            reply = sdk.messages.create(**kwargs)
        replies.append(reply)
        messages.append({"role": "assistant", "content": replay_like_pydantic_ai(reply.content)})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": calculate(json.dumps(b.input))}
            for b in reply.content if b.type == "tool_use"]})
    assert len(replies) == 2 and "\\boxed{51}" in replies[-1].content[-1].text
    for reply in replies:
        thinking = reply.content[0]
        assert thinking.type == "thinking" and thinking.thinking and len(thinking.signature) >= 32
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    assert_turns_are_engine_calls(record, engine_calls_of(thinking_engine, session["session_id"]))
    assert_one_branch(record)
    assert "gateway_forks" not in client.get(f"/runs/{run_id}").json()["stats"]


def _stats(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return client.get(f"/runs/{run_id}").json()["stats"]


def test_changed_thinking_under_its_old_signature_is_an_edited_fork(thinking_run: tuple[httpx.Client, str]) -> None:
    client, run_id = thinking_run
    session = new_session(client, run_id, "edit")
    sdk = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    question = {"role": "user", "content": "What is 4 * 9?"}
    reply = sdk.messages.create(model="m", max_tokens=400, messages=[question], tools=[ANTHROPIC_CALCULATOR])
    [use] = [b for b in reply.content if b.type == "tool_use"]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "36"}]}
    blocks = [b.model_dump(exclude_none=True) for b in reply.content]
    sdk.messages.create(model="m", max_tokens=400, tools=[ANTHROPIC_CALCULATOR],
                        messages=[question, {"role": "assistant", "content": blocks}, result])
    assert "gateway_forks" not in _stats(client, run_id)  # unchanged and signed: the same branch
    changed = [{**blocks[0], "thinking": blocks[0]["thinking"] + " (edited)"}, *blocks[1:]]
    sdk.messages.create(model="m", max_tokens=400, tools=[ANTHROPIC_CALCULATOR],
                        messages=[question, {"role": "assistant", "content": changed}, result])
    forged = [{**blocks[0], "signature": "not-a-signature"}, *blocks[1:]]
    sdk.messages.create(model="m", max_tokens=400, tools=[ANTHROPIC_CALCULATOR],
                        messages=[question, {"role": "assistant", "content": forged}, result])
    stats = _stats(client, run_id)
    assert stats["gateway_forks:edited"] == 2 and stats["gateway_turns"] == 4


def test_responses_encrypted_content_continues_and_a_changed_one_forks(
        thinking_run: tuple[httpx.Client, str]) -> None:
    client, run_id = thinking_run
    session = new_session(client, run_id, "codex-reasoning")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    items: list[Any] = [{"role": "user", "content": "What is 8 * 7?"}]
    plain = sdk.responses.create(model="m", input=items, tools=[TOOL], store=False)
    assert plain.output[0].type == "reasoning" and plain.output[0].encrypted_content is None
    first = sdk.responses.create(model="m", input=items, tools=[TOOL], include=["reasoning.encrypted_content"])
    reasoning, call = first.output[0], first.output[-1]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content and call.type == "function_call"
    echoed = [o.model_dump(exclude_none=True) for o in first.output]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "56"}
    second = sdk.responses.create(model="m", input=[*items, *echoed, output], tools=[TOOL],
                                  include=["reasoning.encrypted_content"])
    assert "\\boxed{56}" in second.output_text
    assert "gateway_forks" not in _stats(client, run_id)
    tampered = [{**echoed[0], "encrypted_content": echoed[0]["encrypted_content"][:-2] + "xx"}, *echoed[1:]]
    sdk.responses.create(model="m", input=[*items, *tampered, output], tools=[TOOL])
    summary = [{**echoed[0], "summary": [{"type": "summary_text", "text": "something else"}]}, *echoed[1:]]
    sdk.responses.create(model="m", input=[*items, *summary, output], tools=[TOOL])
    assert _stats(client, run_id)["gateway_forks:edited"] == 2
