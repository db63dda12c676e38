"""Prompt ids for a session's turns, costing what the client added, not the whole history.

A branch's first turn is the chat template's rendering of the whole request (`PromptTokens.first`). A
later turn is the parent turn's prompt + its output ids (the engine's own, never re-tokenized) + the
tokens of only the messages the client added. Those come from `PromptTokens.continuation_text`, given a
short stand-in for the history before the assistant turn (one user message, and the system message if
the client has one) instead of the history itself: a ChatML template renders each message from the
message and its neighbours only, so the text after the assistant turn is the same, and rendering costs
O(new messages). `check_short_history` proves that equality on a probe conversation once per tokenizer,
and falls back to the full history when it does not hold.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rollout_buffer.api.gateway.json_limits import loads_or_raw
from rollout_buffer.runtime.prompt_tokens import PromptTokens

log = logging.getLogger(__name__)

_PROBE: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "5"},
    {"role": "tool", "tool_call_id": "c1", "content": "5.0"},
    {"role": "user", "content": "And 4 * 4?"},
]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "expression": {"type": "string"}}}}}]


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates render them: tool call `arguments` as objects (OpenAI sends JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**c, "function": {**c.get("function", {}),
                                   "arguments": template_arguments(c.get("function", {}).get("arguments"))}}
                for c in calls]}
        out.append(message)
    return out


def template_arguments(arguments: Any) -> Any:
    return loads_or_raw(arguments) if isinstance(arguments, str) else arguments


def _stand_in(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    head = [history[0]] if history and history[0].get("role") == "system" else []
    return [*head, {"role": "user", "content": "."}]


@functools.lru_cache(maxsize=32)
def check_short_history(tokenizer: Any) -> bool:
    """Whether the stand-in history gives the same continuation text as the real one for this template."""
    try:
        prompt = PromptTokens(tokenizer, _PROBE_TOOLS)
        for before, new in ((_PROBE[:2], _PROBE[3:]), (_PROBE[:5], _PROBE[5:])):
            if prompt.continuation_text(before, new, []) != prompt.continuation_text(_stand_in(before), new, []):
                log.warning("the chat template renders new messages depending on the whole history; the gateway "
                            "renders the whole history for each turn")
                return False
        return True
    except Exception as exc:  # noqa: BLE001 - a template that cannot render the probe: stay exact, render it all
        log.warning("short-history rendering self-check failed (%s); rendering whole histories", exc)
        return False


_RENDER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="gateway-render")


INLINE_CHARS = 16_384  # a render of this much text costs well under a millisecond (bench/README.md)
TOOL_CHARS = 512  # what one tool's schema counts as: the template renders it (twice for a continuation)


def text_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' text and tool-call arguments (what the template renders)."""
    total = 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else 0
        for call in message.get("tool_calls") or ():
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            total += len(arguments) if isinstance(arguments, str) else 0
    return total


async def render_sized(render: Callable[..., np.ndarray], messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, *args: Any) -> np.ndarray:
    """`render(*args)`, where `messages` and `tools` are what it renders: on the event loop when that is small
    (a turn's new messages: a fraction of a millisecond), else in the gateway's render thread, so the loop
    keeps answering (`/health`, other sessions) through a long conversation's render (seconds).

    A small render is not sent to the thread because the hop costs more than the render: two wake-ups of
    the loop, and the thread waiting for the interpreter lock the busy loop holds (up to the 5 ms switch
    interval), then the loop waiting for it back. With 64 streams on one loop that hop was a turn's largest
    wait before its engine call."""
    if text_chars(messages) + TOOL_CHARS * len(tools or ()) <= INLINE_CHARS:
        return render(*args)
    return await asyncio.get_running_loop().run_in_executor(_RENDER_THREAD, render, *args)


class Renderer:
    """Prompt ids of one run's turns (one tokenizer; tools per request)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.short = check_short_history(tokenizer)

    def first(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> np.ndarray:
        return np.asarray(PromptTokens(self.tokenizer, tools).first(for_template(messages)), dtype=np.int32)

    def rendered(self, history: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages `extend` renders (the size of its work)."""
        return [*(_stand_in(history) if self.short else history), *new_messages]

    def extend(self, prompt_ids: np.ndarray, output_ids: np.ndarray, history: list[dict[str, Any]],
               new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> np.ndarray:
        """The next prompt: `prompt_ids + output_ids + tokens(new messages and the generation prompt)`;
        `history` is the conversation before the parent's answer."""
        prompt = PromptTokens(self.tokenizer, tools)
        before = _stand_in(history) if self.short else for_template(history)
        tail = prompt.encode(prompt.continuation_text(before, for_template(new_messages), output_ids.tolist()[-1:]))
        return np.concatenate([prompt_ids, output_ids, np.asarray(tail, dtype=np.int32)]).astype(np.int32)
