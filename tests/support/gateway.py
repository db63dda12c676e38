"""Helpers for the agent gateway tests: an external run, sessions, the calculator tool loop, and the
check of recorded turns against the test engine's own log of every call."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import httpx

from tests.support.runtime_helpers import drain

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
ANTHROPIC_CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                        "input_schema": CALCULATOR["function"]["parameters"]}


def start_external(client: httpx.Client, engine_url: str, tokenizer_path: str, *, repeats: int = 2,
                   **extra: Any) -> str:
    body = {"task_type": "external", "remote_engine_url": engine_url, "tokenizer_path": tokenizer_path,
            "num_repeat_per_sample": repeats, "run_id": f"gw-{uuid.uuid4().hex[:8]}",
            "sampling_params": {"max_tokens": 256, "temperature": 1.0}, **extra}
    response = client.post("/start_rollout", json=body)
    assert response.status_code == 200, response.text
    return response.json()["run_id"]


def new_session(client: httpx.Client, run_id: str, instance_id: str, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/runs/{run_id}/sessions", json={"instance_id": instance_id, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def finish(client: httpx.Client, session: dict[str, Any], reward: float, **extra: Any) -> dict[str, Any]:
    response = client.post(f"/sessions/{session['session_id']}/finish", json={"reward": reward, **extra},
                           headers={"Authorization": f"Bearer {session['api_key']}"})
    assert response.status_code == 200, response.text
    return response.json()


def calculate(arguments: str) -> str:
    from rollout_buffer.testing.engine import evaluate_expression, format_number

    return format_number(evaluate_expression(json.loads(arguments)["expression"]))


def openai_tool_loop(client: Any, questions: list[str], *, stream: bool = False) -> list[dict[str, Any]]:
    """An ordinary OpenAI SDK agent loop: ask, run each tool call, ask the next question; the messages."""
    messages: list[dict[str, Any]] = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        for _ in range(4):
            if stream:
                with client.chat.completions.stream(model="policy", messages=messages, tools=[CALCULATOR],
                                                    stream_options={"include_usage": True}) as events:
                    for _event in events:
                        pass
                    completion = events.get_final_completion()
            else:
                completion = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(call.function.arguments)})
    return messages


def engine_calls_of(engine: Any, session_id: str) -> list[dict[str, Any]]:
    """The engine's log of the session's generations, in order (request ids start with the session id)."""
    return [c for c in engine.call_log() if str(c["rid"]).startswith(f"{session_id}:")]


def assert_turns_are_engine_calls(record: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """Every turn is exactly one engine call: the ids it was sent and the ids and logprobs it sampled."""
    turns = record["turns"]
    assert len(turns) == len(calls) > 0
    for turn, call in zip(turns, calls, strict=True):
        assert list(turn["prompt_ids"]) == call["prompt_ids"]
        assert list(turn["output_ids"]) == call["output_ids"]
        assert [round(x, 5) for x in turn["output_logprobs"]] == [round(x, 5) for x in call["output_logprobs"]]


def assert_one_branch(record: dict[str, Any]) -> None:
    """Each turn's prompt extends the previous prompt and output token for token."""
    for before, after in itertools.pairwise(record["turns"]):
        head = list(before["prompt_ids"]) + list(before["output_ids"])
        assert list(after["prompt_ids"][:len(head)]) == head


def read_group(client: httpx.Client, run_id: str, size: int) -> list[dict[str, Any]]:
    return drain(client, run_id, size, timeout_s=30.0)


def anthropic_tool_loop(client: Any, questions: list[str], *, stream: bool = False,
                        event_types: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """An ordinary Anthropic SDK agent loop (tool_use -> tool_result); returns the messages. With
    `event_types`, each streamed call's event types are appended to it."""
    messages: list[dict[str, Any]] = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        for _ in range(4):
            kwargs = {"model": "policy", "max_tokens": 200, "system": "You are a careful calculator.",
                      "messages": messages, "tools": [ANTHROPIC_CALCULATOR]}
            if stream:
                with client.messages.stream(**kwargs) as events:
                    seen = [event.type for event in events]
                    reply = events.get_final_message()
                if event_types is not None:
                    event_types.append(seen)
            else:
                reply = client.messages.create(**kwargs)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "tool_use":
                assert not uses
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": calculate(json.dumps(b.input))} for b in uses]})
    return messages
