"""Request fields honoured or refused, never silently ignored, with the real SDKs: forced tool calls and
JSON answer formats are constraints sent with the generation (`json_schema` in the sampling parameters, as
SGLang's OpenAI server sends them), Responses answers echo what was sent, and new `instructions` on a
`previous_response_id` chain apply (a changed prefix is a counted fork)."""

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
TOOL = {"type": "function", "name": "calculator", "description": CALCULATOR["function"]["description"],
        "parameters": CALCULATOR["function"]["parameters"]}
NOTE = {"type": "function", "function": {"name": "note", "description": "Write a note.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def _session(client: httpx.Client, engine: Any, tokenizer_path: str, name: str) -> tuple[str, dict[str, Any]]:
    run_id = start_external(client, engine.url, tokenizer_path, repeats=1)
    return run_id, new_session(client, run_id, name)


def _stats(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return client.get(f"/runs/{run_id}").json()["stats"]


def test_forced_tool_calls_are_constrained_and_stay_token_exact(client: httpx.Client, rollout_engine: Any,
                                                                qwen_tokenizer_path: str) -> None:
    run_id, session = _session(client, rollout_engine, qwen_tokenizer_path, "forced")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 14 * 3?"}]
    first = sdk.chat.completions.create(model="m", messages=messages, tools=[NOTE, CALCULATOR], tool_choice="required")
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "calculator" and first.choices[0].finish_reason == "tool_calls"
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)}]
    named = sdk.chat.completions.create(model="m", messages=messages, tools=[NOTE, CALCULATOR],
                                        tool_choice={"type": "function", "function": {"name": "note"}})
    [note] = named.choices[0].message.tool_calls  # the script would answer: the constraint makes it call `note`
    assert note.function.name == "note" and isinstance(json.loads(note.function.arguments)["text"], str)
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    calls = engine_calls_of(rollout_engine, session["session_id"])
    assert_turns_are_engine_calls(record, calls)
    assert_one_branch(record)
    required, one = (json.loads(c["json_schema"]) for c in calls)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert [o["properties"]["name"]["enum"] for o in required["items"]["anyOf"]] == [["note"], ["calculator"]]
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"]["enum"] == ["note"]
    assert "gateway_forks" not in _stats(client, run_id)


def test_responses_and_anthropic_forced_calls(client: httpx.Client, rollout_engine: Any,
                                              qwen_tokenizer_path: str) -> None:
    _, session = _session(client, rollout_engine, qwen_tokenizer_path, "forced-2")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    reply = sdk.responses.create(model="m", input="Hello there.", tools=[TOOL], tool_choice="required",
                                 parallel_tool_calls=False)
    [fc] = reply.output
    assert fc.type == "function_call" and fc.name == "calculator"
    assert reply.tool_choice == "required" and reply.parallel_tool_calls is False
    claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    message = claude.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "Hi."}],
                                     tools=[ANTHROPIC_CALCULATOR], tool_choice={"type": "tool", "name": "calculator"})
    assert message.stop_reason == "tool_use" and [b.name for b in message.content] == ["calculator"]
    schemas = [json.loads(c["json_schema"]) for c in engine_calls_of(rollout_engine, session["session_id"])]
    assert [s["maxItems"] for s in schemas] == [1, 1]


def test_json_answer_formats_are_constrained(client: httpx.Client, rollout_engine: Any,
                                             qwen_tokenizer_path: str) -> None:
    _, session = _session(client, rollout_engine, qwen_tokenizer_path, "json")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    chat = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 6 * 7?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    assert isinstance(json.loads(chat.choices[0].message.content)["answer"], int)
    reply = sdk.responses.create(model="m", input="What is 2 * 9?", store=False, metadata={"k": "v"},
                                 text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}})
    assert isinstance(json.loads(reply.output_text)["answer"], int)
    assert reply.store is False and reply.metadata == {"k": "v"} and reply.text.format.type == "json_schema"
    plain = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}],
                                        response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)
    sent = [c.get("json_schema") for c in engine_calls_of(rollout_engine, session["session_id"])]
    assert [json.loads(s) for s in sent] == [ANSWER, ANSWER, {"type": "object"}]


def test_unenforceable_fields_are_refused_naming_the_field(client: httpx.Client, rollout_engine: Any,
                                                           qwen_tokenizer_path: str) -> None:
    _, session = _session(client, rollout_engine, qwen_tokenizer_path, "refused")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    refused = [
        (lambda: sdk.responses.create(model="m", input="x", tools=[TOOL], tool_choice={"type": "web_search"}),
         "tool_choice"),
        (lambda: sdk.responses.create(model="m", input="x", text={"format": {"type": "xml"}}), "text.format.type"),
        (lambda: sdk.responses.create(model="m", input="x", tool_choice="required"), "tool_choice"),
        (lambda: sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[CALCULATOR],
                                             tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (lambda: sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                             response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
         "response_format"),
    ]
    for call, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["param"] == param, caught.value.body
    claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refusal:
        claude.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}],
                               tools=[ANTHROPIC_CALCULATOR], tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice" in refusal.value.body["error"]["message"]
    assert engine_calls_of(rollout_engine, session["session_id"]) == []


def test_new_instructions_on_a_chain_apply_and_fork(client: httpx.Client, rollout_engine: Any, qwen_tokenizer: Any,
                                                    qwen_tokenizer_path: str) -> None:
    run_id, session = _session(client, rollout_engine, qwen_tokenizer_path, "chain")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    first = sdk.responses.create(model="m", input="What is 3 + 4?", instructions="Be brief.")
    second = sdk.responses.create(model="m", input="And 5 + 6?", previous_response_id=first.id)
    assert second.instructions is None
    third = sdk.responses.create(model="m", input="And 7 + 8?", previous_response_id=second.id,
                                 instructions="Answer in French.")
    assert third.instructions == "Answer in French."
    prompts = [qwen_tokenizer.decode(c["prompt_ids"]) for c in engine_calls_of(rollout_engine, session["session_id"])]
    assert "Be brief." in prompts[1] and "Answer in French." in prompts[2] and "Be brief." not in prompts[2]
    stats = _stats(client, run_id)
    assert stats["gateway_forks:edited"] == 1 and stats["gateway_turns"] == 3


def test_fields_neither_honoured_nor_refused_are_counted_under_bounded_labels(
        client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    run_id, session = _session(client, rollout_engine, qwen_tokenizer_path, "ignored")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    sdk.responses.create(model="m", input="What is 2 + 2?", reasoning={"effort": "low"}, prompt_cache_key="k",
                         extra_body={"a_field_nobody_knows": 1, "another_one": 2})
    sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 3 + 3?"}], user="u",
                                logprobs=True, extra_body={"a_field_nobody_knows": 1})
    stats = _stats(client, run_id)
    for name in ("reasoning", "prompt_cache_key", "user", "logprobs"):
        assert stats[f"gateway_ignored_fields:{name}"] == 1, name
    assert stats["gateway_ignored_fields:other"] == 2  # once per request, whatever the unknown names
    assert not any("nobody" in key or "another" in key for key in stats)
