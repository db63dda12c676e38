"""Anthropic Messages in its exact shape: the request (system, content blocks, tools) read into OpenAI-format
messages, the answer as a `message` with `text` / `thinking` / `tool_use` blocks, or as the full SSE event
sequence (`message_start`, `content_block_start` / `_delta` / `_stop` per block, `message_delta`,
`message_stop`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout_buffer.api.gateway.constraints import NONE, Constraint, forced_calls
from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.history import UNVERIFIED
from rollout_buffer.api.gateway.signing import Signer
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.wire_common import opt_bool, opt_int, opt_number, stop_list, text_of
from rollout_buffer.api.gateway.wire_tools import anthropic_label


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: dict[str, Any]
    stream: bool
    ignored: list[str]
    ignored_tools: list[str]
    constraint: Constraint = NONE


# Fields the gateway reads; anything else a client sends (Claude Code's `thinking`, `context_management`,
# `output_config`, `metadata`, ...) is accepted, ignored and counted (`gateway_ignored_fields:<name>`).
READ_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice", "temperature", "top_p",
                         "top_k", "stop_sequences", "stream"})


def _tools(raw: Any) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """Client tools as OpenAI functions; server tools (`web_search_20250305`, ...) left out, their labels."""
    if raw is None:
        return None, []
    if not isinstance(raw, list):
        raise GatewayError(400, "tools must be a list", "tools")
    tools, ignored = [], []
    for i, tool in enumerate(raw):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            ignored.append(anthropic_label(tool.get("type")))
            continue
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise GatewayError(400, f"tools.{i}: a client tool needs a name and input_schema", f"tools.{i}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise GatewayError(400, f"tools.{i}.input_schema must be an object", f"tools.{i}.input_schema")
        function = {"name": tool["name"], "parameters": schema}
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools or None, ignored


def _result_text(block: dict[str, Any], where: str) -> str:
    return text_of(block.get("content"), f"{where}.content")


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic user message: its tool results as tool messages, then its text as a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content must be a string or a list of blocks", f"{where}.content")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                        "content": _result_text(block, f"{where}.content.{k}")})
        else:
            raise GatewayError(400, f"{where}.content.{k}: block type {kind!r} is not supported in a user message",
                               f"{where}.content.{k}")
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(content: Any, where: str, signer: Signer) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content must be a string or a list of blocks", f"{where}.content")
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, thoughts, calls = [], [], []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking", "")))
            if not signer.verify(thoughts[-1], block.get("signature")):
                message[UNVERIFIED] = True  # not the thinking the gateway signed: the history was edited
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id") or f"toolu_{k}"), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        else:
            raise GatewayError(400, f"{where}.content.{k}: block type {kind!r} is not supported in an assistant "
                                    "message", f"{where}.content.{k}")
    message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None or raw == "":
        return []
    return [{"role": "system", "content": text_of(raw, "system")}]


def read_request(body: dict[str, Any], signer: Signer) -> MessagesRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model: field required (a string)", "model")
    limit = opt_int(body, "max_tokens")
    if limit is None:
        raise GatewayError(400, "max_tokens: field required (an integer >= 1)", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "messages: must be a non-empty list", "messages")
    messages = _system(body.get("system"))
    for i, item in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant", "system"):
            raise GatewayError(400, f"{where}.role must be 'user', 'assistant' or 'system'", f"{where}.role")
        if item["role"] == "system":  # a mid-conversation system message (Claude Code sends them)
            messages.append({"role": "system", "content": text_of(item.get("content"), f"{where}.content")})
        elif item["role"] == "user":
            messages.extend(_user(item.get("content"), where))
        else:
            messages.append(_assistant(item.get("content"), where, signer))
    tools, ignored_tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    constraint = NONE
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise GatewayError(400, "tool_choice.type must be one of auto, any, tool, none", "tool_choice")
        if choice["type"] == "none":
            tools = None
        elif choice["type"] != "auto":  # a forced call: constrained as SGLang constrains OpenAI's "required"
            name = choice.get("name") if choice["type"] == "tool" else None
            if choice["type"] == "tool" and not isinstance(name, str):
                raise GatewayError(400, "tool_choice.name: field required for type tool", "tool_choice.name")
            constraint = forced_calls(tools, name, parallel=not choice.get("disable_parallel_tool_use"))
    params = {"max_new_tokens": limit, "temperature": opt_number(body, "temperature", 0.0, 1.0),
              "top_p": opt_number(body, "top_p", 0.0, 1.0), "top_k": opt_int(body, "top_k"),
              "stop": stop_list(body.get("stop_sequences"), "stop_sequences")}
    return MessagesRequest(model=model, messages=messages, tools=tools,
                           params={k: v for k, v in params.items() if v is not None}, stream=opt_bool(body, "stream"),
                           ignored=sorted(set(body) - READ_FIELDS), ignored_tools=ignored_tools,
                           constraint=constraint)


def stop_reason(answer: TurnAnswer) -> str:
    if answer.parsed.tool_calls:
        return "tool_use"
    return "max_tokens" if answer.engine_finish == "length" else "end_turn"


def blocks(answer: TurnAnswer, signer: Signer) -> list[dict[str, Any]]:
    parsed = answer.parsed
    out: list[dict[str, Any]] = []
    if parsed.reasoning:
        out.append({"type": "thinking", "thinking": parsed.reasoning, "signature": signer.sign(parsed.reasoning)})
    if parsed.content:
        out.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"])})
    return out


def message_id(answer: TurnAnswer, session_id: str) -> str:
    return f"msg_{session_id.rpartition('~')[2]}_{answer.node.index}"


def message(answer: TurnAnswer, session_id: str, model: str, signer: Signer) -> dict[str, Any]:
    return {"id": message_id(answer, session_id), "type": "message", "role": "assistant", "model": model,
            "content": blocks(answer, signer), "stop_reason": stop_reason(answer), "stop_sequence": None,
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}}


def events(answer: TurnAnswer, session_id: str, model: str, signer: Signer) -> Iterator[
        tuple[str, dict[str, Any]]]:
    """The answer as Anthropic's stream: (event name, data)."""
    start = {**message(answer, session_id, model, signer), "content": [], "stop_reason": None,
             "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": 1}}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(blocks(answer, signer)):
        kind = block["type"]
        if kind == "text":
            empty: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": block["signature"]}]
        else:
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": empty}
        if index == 0:
            yield "ping", {"type": "ping"}
        for delta in deltas:
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(answer), "stop_sequence": None},
                            "usage": {"output_tokens": answer.completion_tokens}}
    yield "message_stop", {"type": "message_stop"}
