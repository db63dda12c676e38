"""Hosted and grouped tools through the gateway with the real SDKs: hosted tools (`web_search`, ...) are
left out of the prompt and counted under a bounded label; a Responses `namespace` tool is flattened and the
model's call of one of its functions comes back as OpenAI returns it (`name` + `namespace`, what codex-rs
routes on), and sent back that way it continues the same branch."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

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
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))

MATH = {"type": "namespace", "name": "math", "description": "Arithmetic tools.",
        "tools": [{"type": "function", "name": "calculator", "description": CALCULATOR["function"]["description"],
                   "parameters": CALCULATOR["function"]["parameters"], "strict": False}]}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
                     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}]}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "a_type_nobody_knows"}]


def _stats(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return client.get(f"/runs/{run_id}").json()["stats"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_namespace_call_round_trips_and_hosted_tools_are_counted(
        client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str, stream: bool) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "codex-tools")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    tools = [*HOSTED[:1], AGENTS, MATH, *HOSTED[1:]]

    def ask(items: list[Any]) -> Any:
        if not stream:
            return sdk.responses.create(model="policy", input=items, tools=tools)
        with sdk.responses.stream(model="policy", input=items, tools=tools) as events:
            done = [e.item for e in events if e.type == "response.output_item.done"]
            final = events.get_final_response()
        assert [i.type for i in done] == [o.type for o in final.output]
        return final

    items: list[Any] = [{"role": "user", "content": "What is 14 * 3?"}]
    first = ask(items)
    [fc] = [o for o in first.output if o.type == "function_call"]
    assert (fc.name, fc.namespace) == ("calculator", "math")  # the shape codex-rs routes on
    items += [o.model_dump(exclude_none=True) for o in first.output]
    assert items[-1]["namespace"] == "math"
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": calculate(fc.arguments)})
    second = ask(items)
    assert "\\boxed{42}" in second.output_text
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
    assert_one_branch(record)
    names = [t["function"]["name"] for t in record["tools"]]
    assert names == ["multi_agent_v1.spawn_agent", "math.calculator"], names
    stats = _stats(client, run_id)
    assert "gateway_forks" not in stats
    assert stats["gateway_ignored_tools:web_search"] == stats["gateway_ignored_tools:file_search"] == 2
    assert stats["gateway_ignored_tools:other"] == 2  # an unknown type: a bounded label, not the client's


def test_chat_and_anthropic_leave_hosted_tools_out_and_count_them(
        client: httpx.Client, rollout_engine: Any, qwen_tokenizer: Any, qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "hosted")
    chat = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    answer = chat.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 5 * 5?"}],
        tools=[CALCULATOR, {"type": "custom", "custom": {"name": "patch"}}])
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "calculator"
    claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    reply = claude.messages.create(
        model="policy", max_tokens=200, messages=[{"role": "user", "content": "What is 6 * 6?"}],
        tools=[ANTHROPIC_CALCULATOR, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
               {"type": "bash_20250124", "name": "bash"}, {"type": "strange_20990101", "name": "x"}])
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "calculator" and json.loads(calculate(json.dumps(use.input))) == 36
    stats = _stats(client, run_id)
    assert stats["gateway_ignored_tools:custom"] == 1
    assert stats["gateway_ignored_tools:web_search"] == stats["gateway_ignored_tools:bash"] == 1
    assert stats["gateway_ignored_tools:other"] == 1
    prompts = [qwen_tokenizer.decode(c["prompt_ids"]) for c in engine_calls_of(rollout_engine, session["session_id"])]
    assert len(prompts) == 2 and all('"calculator"' in p and "web_search" not in p and "patch" not in p
                                     for p in prompts)
