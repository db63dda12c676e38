"""OpenAI Responses (what Codex and the OpenAI Agents SDK speak) in its exact shape: `input` items
(messages, `function_call`, `function_call_output`, `reasoning`) read into OpenAI chat messages, the
answer as a `response` with `reasoning` / `message` / `function_call` output items, or as its stream of
typed events (`response.created` ... `response.completed`, each with a `sequence_number`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.wire_common import opt_bool, opt_int, opt_number, text_of

MESSAGE_ROLES = ("user", "system", "developer", "assistant")


@dataclass
class ResponsesRequest:
    model: str
    items: list[dict[str, Any]]  # the new input, as chat messages
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]] | None
    raw_tools: list[dict[str, Any]]
    params: dict[str, Any]
    stream: bool


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise GatewayError(400, "tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise GatewayError(400, f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are "
                                    "supported", f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object",
                                                                                    "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as chat messages; function calls join the assistant message
    they follow."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in MESSAGE_ROLES:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments") or "{}")}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": output if isinstance(output, str) else text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # the session keeps the reasoning it generated; an echo of it renders nothing new
        else:
            raise GatewayError(400, f"{where}: item type {kind!r} is not supported (message, function_call, "
                                    "function_call_output, reasoning)", where)
    return messages


def read_request(body: dict[str, Any]) -> ResponsesRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise GatewayError(400, "model must be a string", "model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "instructions must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise GatewayError(400, "previous_response_id must be a string", "previous_response_id")
    raw_tools = body.get("tools") or []
    tools = _tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = None
    params = {"max_new_tokens": opt_int(body, "max_output_tokens"),
              "temperature": opt_number(body, "temperature", 0.0, 2.0), "top_p": opt_number(body, "top_p", 0.0, 1.0)}
    return ResponsesRequest(model=model or "", items=input_messages(body.get("input")), instructions=instructions,
                            previous_response_id=previous, tools=tools, raw_tools=raw_tools,
                            params={k: v for k, v in params.items() if v is not None}, stream=opt_bool(body, "stream"))


def response_id(session_id: str, index: int) -> str:
    return f"resp_{session_id.rpartition('~')[2]}_{index}"


def turn_of(response: str, session_id: str) -> int | None:
    """The turn a `previous_response_id` of this session names, or None."""
    prefix = f"resp_{session_id.rpartition('~')[2]}_"
    tail = response[len(prefix):] if response.startswith(prefix) else ""
    return int(tail) if tail.isascii() and tail.isdigit() and len(tail) <= 9 else None  # no int() of 5,000 digits


def output_items(answer: TurnAnswer) -> list[dict[str, Any]]:
    parsed, index = answer.parsed, answer.node.index
    items: list[dict[str, Any]] = []
    if parsed.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{index}", "status": "completed",
                      "summary": [{"type": "summary_text", "text": parsed.reasoning}]})
    if parsed.content or not parsed.tool_calls:
        items.append({"type": "message", "id": f"msg_{index}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": parsed.content, "annotations": []}]})
    for k, call in enumerate(parsed.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{index}_{k}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response(answer: TurnAnswer, session_id: str, request: ResponsesRequest, model: str, *,
             status: str | None = None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    cut = answer.engine_finish == "length" and not answer.parsed.tool_calls
    final = "incomplete" if cut else "completed"
    return {
        "id": response_id(session_id, answer.node.index), "object": "response",
        "created_at": int(answer.node.created_at or time.time()), "status": status or final, "model": model,
        "output": output_items(answer) if output is None else output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut and (status or final) == "incomplete" else None,
        "instructions": request.instructions, "metadata": {}, "parallel_tool_calls": True,
        "previous_response_id": request.previous_response_id, "temperature": request.params.get("temperature"),
        "top_p": request.params.get("top_p"), "max_output_tokens": request.params.get("max_new_tokens"),
        "tool_choice": "auto", "tools": request.raw_tools, "text": {"format": {"type": "text"}},
        "truncation": "disabled", "store": True,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens,
                  "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def events(answer: TurnAnswer, session_id: str, request: ResponsesRequest, model: str) -> Iterator[
        tuple[str, dict[str, Any]]]:
    """The answer as the Responses stream: (event type, data with `type` and `sequence_number`)."""
    sequence = 0

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        nonlocal sequence
        sequence += 1
        return kind, {"type": kind, "sequence_number": sequence - 1, **data}

    started = response(answer, session_id, request, model, status="in_progress", output=[])
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for position, item in enumerate(output_items(answer)):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=position,
                        item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": position, "content_index": 0}
            yield event("response.content_part.added", **where, part=part)
            if text:
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part={**part, "text": text})
        elif item["type"] == "function_call":
            yield event("response.output_item.added", output_index=position,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=position,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=position,
                        arguments=item["arguments"])
        else:
            yield event("response.output_item.added", output_index=position, item=item)
        yield event("response.output_item.done", output_index=position, item=item)
    final = response(answer, session_id, request, model)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
