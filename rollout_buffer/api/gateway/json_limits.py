"""Bounded JSON inside requests: tool-call arguments are JSON text inside JSON, parsed again by the gateway
(to render the chat template, to compare histories), and Python's `json` recurses once per level: 3,000
nested brackets raised `RecursionError`, a 500. Nesting is checked before parsing, and a request body's
own nesting is bounded too (the template's `tojson` recurses over it). The request checks answer 400
(`rollout_buffer.api.gateway.wire_common`, `serving`); the parsers fall back to the text."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # tool arguments: deeper than any tool schema a model is trained on
MAX_BODY_DEPTH = 100  # a request body: messages, content blocks, tool_use input, tool schemas


def too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests deeper than `limit`; text with fewer brackets than that in all is not
    scanned (the common case, at C speed)."""
    return text.count("[") + text.count("{") > limit and text_depth(text, stop_above=limit) > limit


def text_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest bracket nesting of JSON text (brackets inside strings do not count); with `stop_above`,
    the scan ends as soon as the nesting passes it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        elif ch in "]}":
            depth -= 1
    return deepest


def value_depth(value: Any) -> int:
    """The nesting depth of a parsed value, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_BODY_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in items)
    return deepest


def arguments_problem(messages: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(field, reason) of the first tool call whose arguments nest deeper than `MAX_DEPTH`, else None."""
    for i, message in enumerate(messages):
        for k, call in enumerate(message.get("tool_calls") or ()):
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            if isinstance(arguments, str) and too_deep(arguments):
                return (f"messages[{i}].tool_calls[{k}].function.arguments",
                        f"tool-call arguments nest deeper than {MAX_DEPTH} levels")
    return None


def loads_or_raw(raw: str) -> Any:
    """Tool-call arguments as JSON when they are JSON of bounded nesting, else the text itself."""
    if too_deep(raw):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def loose_json(raw: str) -> Any:
    """A model's output parsed leniently: the value, or None when it is not JSON or nests too deep."""
    parsed = loads_or_raw(raw)
    return None if parsed is raw else parsed
