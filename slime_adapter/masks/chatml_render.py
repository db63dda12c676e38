"""A compiled renderer for ChatML chat templates (the Qwen2.5 family), used only where it is proven equal.

The message path renders every conversation with the tokenizer's Jinja chat template; for short tool-use
conversations that render costs about as much as tokenizing the result (the Jinja runtime's per-node
calls, `tojson` of every tool schema). `ChatMLRenderer` writes the same text with plain string joins.
It is never trusted on its description: `verified_renderer` renders a probe corpus (tools, tool calls with
string and mapping `arguments`, consecutive tool results, whitespace at turn edges, `<think>` blocks, a
conversation without a system message, a later system message) both ways, and returns a renderer only if
every text is identical, character for character (so the tokens are identical too); otherwise the caller
keeps Jinja. Input outside what was proven (non-string content, odd tool-call shapes, values that are not
plain JSON) makes `render` return None, and the caller renders that conversation with Jinja.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["ChatMLRenderer", "PROBE_CONVERSATIONS", "PROBE_TOOLS", "verified_renderer"]

Message = dict[str, Any]
ArgumentsMode = Literal["raw", "json"]

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


class _Unsupported(Exception):
    """Input the compiled renderer was not proven on: render it with Jinja."""


def _tojson(value: Any) -> str:
    """transformers' `tojson` filter (non-ASCII kept, default separators)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # not plain JSON: transformers would render a placeholder
        raise _Unsupported from exc


def _content(message: Message) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if type(content) is not str:
        raise _Unsupported
    return content


class ChatMLRenderer:
    """Qwen2.5-style ChatML, as its template renders it without a generation prompt. `arguments`: how a
    tool call's string `arguments` are written ("raw": as they are; "json": quoted by `tojson`, as the
    released Qwen2.5 template does); mapping arguments are always `tojson`."""

    def __init__(self, arguments: ArgumentsMode = "raw", default_system: str = DEFAULT_SYSTEM) -> None:
        self.arguments = arguments
        self.default_system = default_system

    def _call(self, call: Any) -> str:
        if type(call) is not dict:
            raise _Unsupported
        fn = call["function"] if "function" in call else call
        if type(fn) is not dict or type(fn.get("name")) is not str or "arguments" not in fn:
            raise _Unsupported
        args = fn["arguments"]
        text = args if type(args) is str and self.arguments == "raw" else _tojson(args)
        return '\n<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + text + "}\n</tool_call>"

    def _render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> str:
        out: list[str] = []
        first = messages[0] if messages else None
        if first is not None and type(first) is not dict:
            raise _Unsupported
        system = _content(first) if first is not None and first.get("role") == "system" else self.default_system
        if tools:
            if type(tools) is not list:
                raise _Unsupported
            out.append("<|im_start|>system\n" + system + _TOOLS_HEAD)
            out.extend("\n" + _tojson(tool) for tool in tools)
            out.append(_TOOLS_TAIL)
        else:
            out.append("<|im_start|>system\n" + system + "<|im_end|>\n")
        last = len(messages) - 1
        for i, message in enumerate(messages):
            if type(message) is not dict:
                raise _Unsupported
            role = message.get("role")
            if type(role) is not str:
                raise _Unsupported
            content = _content(message)
            if role == "user" or (role == "system" and i > 0):
                out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
            elif role == "assistant":
                calls = message.get("tool_calls")
                if calls:
                    if type(calls) is not list:
                        raise _Unsupported
                    out.append("<|im_start|>assistant" + ("\n" + content if content else ""))
                    out.extend(self._call(call) for call in calls)
                    out.append("<|im_end|>\n")
                else:
                    out.append("<|im_start|>assistant\n" + content + "<|im_end|>\n")
            elif role == "tool":
                if i == 0 or messages[i - 1].get("role") != "tool":
                    out.append("<|im_start|>user")
                out.append("\n<tool_response>\n" + content + "\n</tool_response>")
                if i == last or messages[i + 1].get("role") != "tool":
                    out.append("<|im_end|>\n")
            elif role != "system":
                raise _Unsupported  # a role the template may reject: let it say so
        return "".join(out)

    def render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> str | None:
        """The conversation's text, or None for input this renderer was not proven on."""
        try:
            return self._render(messages, tools)
        except (_Unsupported, AttributeError, TypeError):
            return None


PROBE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. \"2 * (3 + 4)\".",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Suche im Web — unicode ok.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}}}},
]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


PROBE_CONVERSATIONS: list[list[Message]] = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "  leading and trailing spaces \n"},
     {"role": "assistant", "content": "\n<think>\nadd them\n</think>\n\nThe answer is 4.\n"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Compute 6*7 then search it."},
     {"role": "assistant", "content": "<think>two calls</think>", "tool_calls": [
         _call("calculator", '{"expression": "6*7"}'), _call("search", {"query": "42", "k": 3})]},
     {"role": "tool", "content": "42"}, {"role": "tool", "content": " several results \n"},
     {"role": "assistant", "content": "", "tool_calls": [_call("calculator", {"expression": "42 + 0"})]},
     {"role": "tool", "content": "42"},
     {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "You're welcome — 42."}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                         "tool_calls": [_call("search", '{"query": "ü"}')]},
     {"role": "tool", "content": "r"}, {"role": "system", "content": "late system"},
     {"role": "assistant", "content": "\n\n"}],
]
PROBE_TOOL_SETS: list[list[dict[str, Any]] | None] = [None, None, PROBE_TOOLS, PROBE_TOOLS[1:]]


def verified_renderer(tokenizer: Any) -> ChatMLRenderer | None:
    """A compiled renderer whose text equals the tokenizer's Jinja template on every probe conversation
    (each also rendered without tools), or None when no variant does."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return None
    try:
        expected = [tokenizer.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=False)
                    for conv, tools in zip(PROBE_CONVERSATIONS, PROBE_TOOL_SETS)
                    for m, t in ((conv, tools), (conv, None))]
    except Exception:  # noqa: BLE001 - a template that rejects the probe is simply not this family
        return None
    for mode in ("raw", "json"):
        renderer = ChatMLRenderer(arguments=mode)  # type: ignore[arg-type]
        got = [renderer.render(m, t) for conv, tools in zip(PROBE_CONVERSATIONS, PROBE_TOOL_SETS)
               for m, t in ((conv, tools), (conv, None))]
        if got == expected:
            return renderer
    return None
