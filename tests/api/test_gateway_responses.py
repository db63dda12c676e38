"""The agent gateway's OpenAI Responses API with the real OpenAI SDK: tool loops re-sending the items
(as Codex does) or chaining `previous_response_id`, plain and streamed; records token-exact."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import (
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

TOOL = {"type": "function", "name": "calculator", "description": CALCULATOR["function"]["description"],
        "parameters": CALCULATOR["function"]["parameters"]}


SERVER = ServerSpec(args=("--session-timeout-s", "60"))



def call(sdk: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    if not stream:
        return sdk.responses.create(model="policy", tools=[TOOL], **kwargs)
    with sdk.responses.stream(model="policy", tools=[TOOL], **kwargs) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final.output)
    return final


@pytest.mark.parametrize("chained", [False, True], ids=["items", "previous_response_id"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_tool_loop(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str,
                             stream: bool, chained: bool) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "codex-like")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    items: list[Any] = [{"role": "user", "content": "What is 14 * 3?"}]
    first = call(sdk, stream, input=items, instructions="Use the calculator.")
    assert first.object == "response" and first.status == "completed"
    [fc] = [o for o in first.output if o.type == "function_call"]
    assert fc.name == "calculator" and json.loads(fc.arguments)["expression"]
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": calculate(fc.arguments)}
    if chained:
        second = call(sdk, stream, input=[output], previous_response_id=first.id)
    else:
        items += [o.model_dump(exclude_none=True) for o in first.output] + [output]
        second = call(sdk, stream, input=items, instructions="Use the calculator.")
    assert "\\boxed{42}" in second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
    assert_one_branch(record)
    assert record["messages"][0] == {"role": "system", "content": "Use the calculator."}
    assert "gateway_forks" not in client.get(f"/runs/{run_id}").json()["stats"]


def test_responses_errors_are_openai_shaped(client: httpx.Client, rollout_engine: Any,
                                            qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "bad")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    for kwargs, param in (({"input": []}, "input"), ({"input": [{"type": "web_search_call"}]}, "input[0]"),
                          ({"input": "hi", "previous_response_id": "resp_nope_1"}, "previous_response_id"),
                          ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0]")):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model="m", **kwargs)
        assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"
