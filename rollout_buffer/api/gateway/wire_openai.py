"""OpenAI Chat Completions in its exact shape: the request read into messages, tools and sampling
parameters; the answer as a `chat.completion`, or as `chat.completion.chunk` events for a stream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout_buffer.api.gateway.constraints import NONE, Constraint, forced_calls, json_answer
from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.wire_common import opt_bool, opt_int, opt_number, stop_list, text_of
from rollout_buffer.api.gateway.wire_tools import openai_label

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    ignored_tools: list[str]
    constraint: Constraint = NONE


def check_tools(tools: Any) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """OpenAI function tools, checked; other tool types (`custom`, hosted ones) left out, their labels."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise GatewayError(400, "tools must be a list", "tools")
    kept, ignored = [], []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") not in ("function", None):
            ignored.append(openai_label(tool.get("type")))
            continue
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise GatewayError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                               f"tools[{i}]")
        kept.append(tool)
    return kept or None, ignored


def _message(i: int, raw: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        raise GatewayError(400, f"{where} must be an object with role one of {', '.join(ROLES)}", where)
    role = "system" if raw["role"] == "developer" else raw["role"]
    message: dict[str, Any] = {"role": role, "content": text_of(raw.get("content"), f"{where}.content")}
    if role == "assistant" and raw.get("tool_calls"):
        calls = raw["tool_calls"]
        if not isinstance(calls, list):
            raise GatewayError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        message["tool_calls"] = []
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise GatewayError(400, f"{where}.tool_calls[{k}] needs function.name", f"{where}.tool_calls[{k}]")
            message["tool_calls"].append({"id": str(call.get("id") or f"call_{k}"), "type": "function",
                                          "function": {"name": function["name"],
                                                       "arguments": function.get("arguments") or "{}"}})
    if role == "tool":
        message["tool_call_id"] = str(raw.get("tool_call_id") or "")
    if role == "assistant" and raw.get("reasoning_content"):
        message["reasoning_content"] = str(raw["reasoning_content"])
    return message


def _constraint(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Constraint:
    """`tool_choice` "required" / a named function, else `response_format`, as a generation constraint."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls") is not False
    if choice == "required":
        return forced_calls(tools, None, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if not isinstance(name, str):
            raise GatewayError(400, "tool_choice.function.name must be a string", "tool_choice")
        return forced_calls(tools, name)
    if choice not in (None, "none", "auto"):
        raise GatewayError(400, "tool_choice must be 'none', 'auto', 'required' or a function", "tool_choice")
    fmt = body.get("response_format")
    if fmt is None:
        return NONE
    if not isinstance(fmt, dict):
        raise GatewayError(400, "response_format must be an object", "response_format")
    spec = fmt.get("json_schema")
    return json_answer(fmt.get("type"), spec.get("schema") if isinstance(spec, dict) else None, "response_format")


def read_request(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", "messages")
    n = opt_int(body, "n")
    if n not in (None, 1):
        raise GatewayError(400, "n must be 1: a session is one trajectory", "n")
    tools, ignored_tools = check_tools(body.get("tools"))
    constraint = _constraint(body, tools)
    if body.get("tool_choice") == "none":
        tools = None
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "stream_options must be an object", "stream_options")
    limit = opt_int(body, "max_completion_tokens") or opt_int(body, "max_tokens")
    params = {"max_new_tokens": limit, "temperature": opt_number(body, "temperature", 0.0, 2.0),
              "top_p": opt_number(body, "top_p", 0.0, 1.0), "stop": stop_list(body.get("stop"), "stop"),
              "seed": opt_int(body, "seed", minimum=0)}
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise GatewayError(400, "model must be a string", "model")
    return ChatRequest(model=model or "", messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools,
                       params={k: v for k, v in params.items() if v is not None}, stream=opt_bool(body, "stream"),
                       include_usage=bool((options or {}).get("include_usage")), ignored_tools=ignored_tools,
                       constraint=constraint)


def finish_reason(answer: TurnAnswer) -> str:
    if answer.parsed.tool_calls:
        return "tool_calls"
    return "length" if answer.engine_finish == "length" else "stop"


def completion_id(answer: TurnAnswer, session_id: str) -> str:
    return f"chatcmpl-{session_id.rpartition('~')[2]}-{answer.node.index}"


def usage(answer: TurnAnswer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


def completion(answer: TurnAnswer, session_id: str, model: str) -> dict[str, Any]:
    parsed = answer.parsed
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or not parsed.tool_calls else None}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    return {"id": completion_id(answer, session_id), "object": "chat.completion",
            "created": int(answer.node.created_at or time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(answer)}],
            "usage": usage(answer)}


def chunks(answer: TurnAnswer, session_id: str, model: str, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The answer as `chat.completion.chunk` objects: role, reasoning, content, tool calls, finish, usage."""
    head = {"id": completion_id(answer, session_id), "object": "chat.completion.chunk",
            "created": int(answer.node.created_at or time.time()), "model": model}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    parsed = answer.parsed
    yield chunk({"role": "assistant", "content": ""})
    if parsed.reasoning:
        yield chunk({"reasoning_content": parsed.reasoning})
    if parsed.content:
        yield chunk({"content": parsed.content})
    for i, call in enumerate(parsed.tool_calls):
        function = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": function["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]})
    yield chunk({}, finish_reason(answer))
    if include_usage:
        yield {**head, "choices": [], "usage": usage(answer)}
