"""Turn raw model output text into an OpenAI-style assistant message.

Workers that talk to ``/generate`` get text, not a message; the trainer and task
code want ``content``, ``reasoning_content`` and ``tool_calls`` the way SGLang's
chat endpoint would report them for Qwen-family models.
"""

from __future__ import annotations

import json
import re
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# End-of-turn markers a detokenizer may leave in the text when special tokens are kept.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<｜end▁of▁sentence｜>")

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def strip_end_markers(text: str) -> str:
    """Remove trailing end-of-turn markers (and whitespace before them)."""
    changed = True
    while changed:
        changed = False
        stripped = text.rstrip()
        for marker in END_MARKERS:
            if stripped.endswith(marker):
                text = stripped[: -len(marker)]
                changed = True
    return text


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split text into (reasoning, rest); reasoning is None when there is no think block.

    Handles prompts that already opened ``<think>`` (the text then starts inside the
    block and only closes it) and outputs cut off before ``</think>``.
    """
    close = text.find(THINK_CLOSE)
    if close < 0:
        open_at = text.find(THINK_OPEN)
        if open_at < 0:
            return None, text
        return text[open_at + len(THINK_OPEN) :].strip(), text[:open_at]
    head, tail = text[:close], text[close + len(THINK_CLOSE) :]
    open_at = head.find(THINK_OPEN)
    prefix = ""
    if open_at >= 0:
        prefix, head = head[:open_at], head[open_at + len(THINK_OPEN) :]
    return head.strip(), prefix + tail


def parse_call_json(body: str) -> tuple[str, dict[str, Any], str | None] | None:
    """The one rule for a JSON tool call body, shared by the task runtime and the agent gateway.

    Returns (name, arguments, arguments as the model wrote them when it wrote a JSON string) or None when
    the body is malformed: not JSON, no non-empty `name`, or `arguments` (also `parameters`) that are not
    an object, given as an object or as a string holding one (OpenAI's tool calls carry string arguments).
    """
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a model's output nested thousands deep
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = obj.get("arguments", obj.get("parameters", {}))
    written = raw if isinstance(raw, str) else None
    args = raw
    if written is not None:
        try:
            args = json.loads(written)
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    return (obj["name"], args, written) if isinstance(args, dict) else None


_XML_CALL_RE = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_XML_PARAM_RE = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(raw: str) -> Any:
    """A parameter's value: JSON when it is JSON (a number, an object), else the text itself."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def parse_call_xml(body: str) -> tuple[str, dict[str, Any]] | None:
    """A Qwen3.5 / Qwen3-Coder call body, `<function=NAME><parameter=ARG>VALUE</parameter></function>`."""
    match = _XML_CALL_RE.fullmatch(body.strip())
    if match is None:
        return None
    return match.group(1), {p.group(1): _xml_value(p.group(2)) for p in _XML_PARAM_RE.finditer(match.group(2))}


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) for a well-formed tool call body (JSON, or the XML form), the model's own string
    kept as written."""
    xml = parse_call_xml(body) if body.lstrip().startswith("<function=") else None
    if xml is not None:
        return xml[0], json.dumps(xml[1], ensure_ascii=False)
    parsed = parse_call_json(body)
    if parsed is None:
        return None
    name, args, written = parsed
    return name, written if written is not None else json.dumps(args, ensure_ascii=False)


def extract_tool_calls(text: str, *, id_prefix: str = "call") -> tuple[str, list[dict[str, Any]]]:
    """Pull well-formed ``<tool_call>`` blocks out of text; malformed ones stay in it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL_RE.finditer(text):
        parsed = _parse_call(match.group(1).strip())
        if parsed is None:
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        name, arguments = parsed
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    kept.append(text[pos:])
    return "".join(kept), calls


def parse_assistant_text(text: str, *, id_prefix: str = "call") -> dict[str, Any]:
    """Parse generated text into ``{"role": "assistant", "content", ...}``.

    Adds ``reasoning_content`` when the text has a think block and ``tool_calls`` for
    each well-formed Qwen tool call; tool call ids are ``f"{id_prefix}_{i}"``.
    """
    reasoning, rest = split_reasoning(strip_end_markers(text))
    content, calls = extract_tool_calls(rest, id_prefix=id_prefix)
    message: dict[str, Any] = {"role": "assistant", "content": content.strip()}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
