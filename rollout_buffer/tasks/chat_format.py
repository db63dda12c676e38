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


def _parse_call(body: str) -> tuple[str, str] | None:
    """Return (name, arguments JSON) for a well-formed tool call body, else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return obj["name"], args
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


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
