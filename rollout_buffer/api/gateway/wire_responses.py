"""OpenAI Responses (what Codex and the OpenAI Agents SDK speak) in its exact shape: `input` items
(messages, `function_call`, `function_call_output`, `reasoning`) read into OpenAI chat messages, the
answer as a `response` with `reasoning` / `message` / `function_call` output items, or as its stream of
typed events (`response.created` ... `response.completed`, each with a `sequence_number`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout_buffer.api.gateway.constraints import NONE, Constraint, forced_calls, json_answer
from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.history import UNVERIFIED
from rollout_buffer.api.gateway.signing import Signer
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.wire_common import opt_bool, opt_int, opt_number, text_of
from rollout_buffer.api.gateway.wire_tools import ToolSet, flat_name, responses_tools

MESSAGE_ROLES = ("user", "system", "developer", "assistant")


@dataclass
class ResponsesRequest:
    model: str
    items: list[dict[str, Any]]  # the new input, as chat messages
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]] | None
    raw_tools: list[dict[str, Any]]
    toolset: ToolSet
    params: dict[str, Any]
    stream: bool
    signer: Signer
    include: list[str]
    echo: dict[str, Any]  # what the answer repeats as sent: tool_choice, parallel_tool_calls, store, text
    constraint: Constraint = NONE


def _unverified_reasoning(item: dict[str, Any], signer: Signer) -> str | None:
    """None when a reasoning item's `encrypted_content` (if any) is this server's and matches its summary;
    else the reasoning as the client sent it."""
    sealed = item.get("encrypted_content")
    if sealed is None:
        return None  # nothing to check: a client that did not ask for it echoes the summary only
    text = signer.unseal(sealed)
    summary = item.get("summary")
    shown = "".join(str(p.get("text", "")) for p in summary if isinstance(p, dict)) \
        if isinstance(summary, list) and summary else None
    if text is not None and shown in (None, text):
        return None
    return shown if shown is not None else str(sealed)


def input_messages(raw: Any, signer: Signer) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as chat messages; function calls join the assistant message
    they follow; a reasoning item that fails its signature marks the assistant message after it."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    edited: str | None = None  # the reasoning of an item that failed its check, until its assistant message
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in MESSAGE_ROLES:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": flat_name(item["name"], item.get("namespace")),
                                 "arguments": str(item.get("arguments") or "{}")}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": output if isinstance(output, str) else text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            # the session keeps the reasoning it generated; an echo of it renders nothing new
            edited = _unverified_reasoning(item, signer) or edited
            continue
        else:
            raise GatewayError(400, f"{where}: item type {kind!r} is not supported (message, function_call, "
                                    "function_call_output, reasoning)", where)
        if edited is not None and messages[-1]["role"] == "assistant":
            messages[-1].update({UNVERIFIED: True, "reasoning_content": edited})
            edited = None
    return messages


def _constraint(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Constraint:
    """`tool_choice` "required" / a function (a namespaced one by `namespace`), else `text.format`."""
    choice = body.get("tool_choice")
    if choice == "required":
        return forced_calls(tools, None, parallel=body.get("parallel_tool_calls") is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return forced_calls(tools, flat_name(choice["name"], choice.get("namespace")))
    if choice not in (None, "none", "auto"):
        raise GatewayError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': "
                                "...} (hosted tools and allowed_tools are not supported)", "tool_choice")
    text = body.get("text")
    if text is None:
        return NONE
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or not isinstance(fmt, (dict, type(None))):
        raise GatewayError(400, "text must be an object with an object format", "text")
    return NONE if fmt is None else json_answer(fmt.get("type"), fmt.get("schema"), "text.format")


def read_request(body: dict[str, Any], signer: Signer) -> ResponsesRequest:
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
    toolset = responses_tools(body.get("tools"))
    tools = toolset.tools or None
    constraint = _constraint(body, tools)
    if body.get("tool_choice") == "none":
        tools = None
    echo = {"tool_choice": body.get("tool_choice") or "auto", "text": body.get("text") or {"format": {"type": "text"}},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "store": body.get("store") is not False, "metadata": body.get("metadata") or {}}
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise GatewayError(400, "include must be a list of strings", "include")
    params = {"max_new_tokens": opt_int(body, "max_output_tokens"),
              "temperature": opt_number(body, "temperature", 0.0, 2.0), "top_p": opt_number(body, "top_p", 0.0, 1.0)}
    return ResponsesRequest(model=model or "", items=input_messages(body.get("input"), signer),
                            instructions=instructions, previous_response_id=previous, tools=tools,
                            raw_tools=raw_tools, toolset=toolset,
                            params={k: v for k, v in params.items() if v is not None}, stream=opt_bool(body, "stream"),
                            signer=signer, include=include, echo=echo, constraint=constraint)


def response_id(session_id: str, index: int) -> str:
    return f"resp_{session_id.rpartition('~')[2]}_{index}"


def turn_of(response: str, session_id: str) -> int | None:
    """The turn a `previous_response_id` of this session names, or None."""
    prefix = f"resp_{session_id.rpartition('~')[2]}_"
    tail = response[len(prefix):] if response.startswith(prefix) else ""
    return int(tail) if tail.isascii() and tail.isdigit() and len(tail) <= 9 else None  # no int() of 5,000 digits


def output_items(answer: TurnAnswer, request: ResponsesRequest) -> list[dict[str, Any]]:
    parsed, index = answer.parsed, answer.node.index
    items: list[dict[str, Any]] = []
    if parsed.reasoning:
        reasoning = {"type": "reasoning", "id": f"rs_{index}", "status": "completed",
                     "summary": [{"type": "summary_text", "text": parsed.reasoning}]}
        if "reasoning.encrypted_content" in request.include:
            reasoning["encrypted_content"] = request.signer.seal(parsed.reasoning)
        items.append(reasoning)
    if parsed.content or not parsed.tool_calls:
        items.append({"type": "message", "id": f"msg_{index}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": parsed.content, "annotations": []}]})
    for k, call in enumerate(parsed.tool_calls):
        name, namespace = request.toolset.split(call["function"]["name"])
        item = {"type": "function_call", "id": f"fc_{index}_{k}", "call_id": call["id"], "name": name,
                "arguments": call["function"]["arguments"], "status": "completed"}
        items.append(item if namespace is None else {**item, "namespace": namespace})
    return items


def started(session_id: str, index: int, created: int, request: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response as a stream opens it: in progress, no output yet."""
    return _envelope(session_id, index, created, request, model, "in_progress")


def _envelope(session_id: str, index: int, created: int, request: ResponsesRequest, model: str,
              status: str) -> dict[str, Any]:
    return {
        "id": response_id(session_id, index), "object": "response", "created_at": created, "status": status,
        "model": model, "output": [], "error": None, "incomplete_details": None, "instructions": request.instructions,
        "previous_response_id": request.previous_response_id, "temperature": request.params.get("temperature"),
        "top_p": request.params.get("top_p"), "max_output_tokens": request.params.get("max_new_tokens"),
        "tools": request.raw_tools, "truncation": "disabled", **request.echo}


def response(answer: TurnAnswer, session_id: str, request: ResponsesRequest, model: str, *,
             status: str | None = None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    cut = answer.engine_finish == "length" and not answer.parsed.tool_calls
    final = "incomplete" if cut else "completed"
    body = _envelope(session_id, answer.node.index, int(answer.node.created_at or time.time()), request, model,
                     status or final)
    return {
        **body, "output": output_items(answer, request) if output is None else output,
        "incomplete_details": {"reason": "max_output_tokens"} if cut and (status or final) == "incomplete" else None,
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
    for position, item in enumerate(output_items(answer, request)):
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
