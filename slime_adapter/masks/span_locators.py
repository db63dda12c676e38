"""Where each chat template renders an assistant message's generated text: one locator per template type.

A locator reads the rendered conversation (text, not tokens) and returns one character span per assistant
message, from the first character the policy generated through its end-of-turn token. Text that does not
parse as the template's structure raises `LossMaskError`: the conversation is then not a chat this
template produced, and the message path refuses it (see `slime_adapter.masks.loss_mask`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "LossMaskError",
    "CharSpan",
    "AssistantSpanLocator",
    "ChatMLSpanLocator",
    "Qwen3SpanLocator",
    "Qwen35SpanLocator",
    "DistillQwenSpanLocator",
    "register_loss_mask_type",
    "loss_mask_types",
    "locator_class",
]

Message = dict[str, Any]


class LossMaskError(ValueError):
    """The conversation cannot be rendered and located exactly: it is refused, never guessed at."""


@dataclass(frozen=True)
class CharSpan:
    """Half-open character range `[start, end)` of one assistant message's generated text."""

    start: int
    end: int


def text_of(content: Any) -> str:
    """Message content as the templates render it (string, or the text parts of a list)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def assistant_messages(messages: Sequence[Message]) -> list[Message]:
    return [m for m in messages if m.get("role") == "assistant"]


class AssistantSpanLocator(ABC):
    """Knows one chat template's structure: where each assistant message's generated text is rendered."""

    #: the end-of-turn token the policy generates to close a message (masked 1)
    end_token: ClassVar[str]
    #: text that starts one rendered tool call inside an assistant span
    tool_call_marker: ClassVar[str]

    @classmethod
    def control_tokens(cls) -> tuple[str, ...]:
        """Template control strings; those that are added tokens of the tokenizer must each become exactly
        one id per occurrence (the cheap check of special-token handling)."""
        return (cls.end_token,)

    def prepare_messages(self, messages: Sequence[Message]) -> list[Message]:
        """The messages as the serving engine hands them to this template (default: unchanged)."""
        return list(messages)

    @abstractmethod
    def find_spans(self, text: str) -> list[CharSpan]:
        """Every assistant-generated span in `text`, in order; raise `LossMaskError` if ambiguous."""

    def locate(self, text: str, messages: Sequence[Message]) -> list[CharSpan]:
        """Spans matched one-to-one with the assistant messages, each checked against its message."""
        spans = self.find_spans(text)
        assistants = assistant_messages(messages)
        if len(spans) != len(assistants):
            raise LossMaskError(
                f"rendering has {len(spans)} assistant span(s) for {len(assistants)} assistant message(s); "
                "message text probably contains template control tokens"
            )
        for i, (span, message) in enumerate(zip(spans, assistants)):
            self.check_span(text[span.start:span.end], message, i)
        return spans

    def check_span(self, span_text: str, message: Message, index: int) -> None:
        """Cheap consistency check that span `index` really renders `message`."""
        if not span_text.endswith(self.end_token):
            raise LossMaskError(f"assistant span {index} does not end with {self.end_token!r}")
        answer = text_of(message.get("content")).split("</think>")[-1].strip()
        if answer and answer not in span_text:
            raise LossMaskError(f"assistant span {index} does not contain its message's content")
        calls = message.get("tool_calls") or []
        if span_text.count(self.tool_call_marker) < len(calls):
            raise LossMaskError(f"assistant span {index} renders fewer than its {len(calls)} tool call(s)")


class ChatMLSpanLocator(AssistantSpanLocator):
    """Qwen2.5 ChatML: `<|im_start|>ROLE\\n ... <|im_end|>\\n` blocks; assistant text follows `assistant\\n`.

    Qwen2.5 renders an assistant with only tool calls as `<|im_start|>assistant` + `\\n<tool_call>...`, which
    is the same characters: the generated part still starts right after `assistant\\n`.
    """

    start_token: ClassVar[str] = "<|im_start|>"
    end_token: ClassVar[str] = "<|im_end|>"
    tool_call_marker: ClassVar[str] = "<tool_call>"
    assistant_header: ClassVar[str] = "assistant\n"

    @classmethod
    def control_tokens(cls) -> tuple[str, ...]:
        return (cls.start_token, cls.end_token)

    def generated_start(self, text: str, body_start: int) -> int:
        """First generated character of the assistant block whose text starts at `body_start`."""
        return body_start

    def find_spans(self, text: str) -> list[CharSpan]:
        spans: list[CharSpan] = []
        start_tok, end_tok = self.start_token, self.end_token
        pos = 0
        while True:
            begin = text.find(start_tok, pos)
            if begin < 0:
                if text[pos:].strip():
                    raise LossMaskError(f"text after the last {end_tok} block: {text[pos:pos + 40]!r}")
                return spans
            if text[pos:begin].strip():
                raise LossMaskError(f"text outside any {start_tok} block at char {pos}: {text[pos:begin][:40]!r}")
            body = begin + len(start_tok)
            finish = text.find(end_tok, body)
            following = text.find(start_tok, body)
            if finish < 0 or (0 <= following < finish):
                if text.startswith(self.assistant_header, body):
                    raise LossMaskError(f"assistant block at char {begin} has no {end_tok} before the next block")
                if finish < 0:
                    return spans  # an unterminated non-assistant block ends the text (generation prompt)
                raise LossMaskError(f"block at char {begin} is not closed before the next {start_tok}")
            if text.startswith(self.assistant_header, body):
                spans.append(CharSpan(self.generated_start(text, body + len(self.assistant_header)),
                                      finish + len(end_tok)))
            pos = finish + len(end_tok)


class Qwen3SpanLocator(ChatMLSpanLocator):
    """Qwen3: ChatML plus `<think>` blocks. The template drops reasoning from turns before the last user
    query, so the mask covers exactly what the rendering contains (reasoning only where it is shown).
    Qwen3's generation prompt is `<|im_start|>assistant\\n`: the policy generates its own `<think>`."""


class Qwen35SpanLocator(ChatMLSpanLocator):
    """Qwen3.5 (slime's `qwen3_5`): ChatML whose generation prompt ends with `<think>\\n`.

    The template renders every assistant turn after the last user query as `<|im_start|>assistant\\n<think>\\n`
    + reasoning + `\\n</think>\\n\\n` + content, and earlier turns without the think block; message text is
    trimmed. The engine's prompt ended with `<think>\\n`, so the policy never generated it: a block that
    starts with it has its generated part start after it (slime's `gen_multi_turn_loss_mask_qwen3_5` draws
    the same line). With empty reasoning the `\\n` of `<think>\\n` and the generated `\\n</think>` meet as one
    `\\n\\n` token: an edge token (mask 0, counted).

    Tool calls are rendered from argument mappings (`<parameter=NAME>`); OpenAI's `arguments` is a JSON
    string, which SGLang parses into a mapping before applying the template (`serving_chat`'s
    `normalize_assistant_tool_call_arguments`, a 400 when it is not a JSON object). `prepare_messages` does
    the same, so the rendering is the one the engine saw; arguments that are not a JSON object are refused.

    Unlike slime's generator, the `\\n` after `<|im_end|>` is not trained: the engine stops at `<|im_end|>`.
    """

    think_prefix: ClassVar[str] = "<think>\n"

    def generated_start(self, text: str, body_start: int) -> int:
        if text.startswith(self.think_prefix, body_start):
            return body_start + len(self.think_prefix)
        return body_start

    def prepare_messages(self, messages: Sequence[Message]) -> list[Message]:
        return normalize_tool_call_arguments(messages)


def normalize_tool_call_arguments(messages: Sequence[Message]) -> list[Message]:
    """Copies of the messages whose assistant tool calls carry `arguments` as a mapping (parsed from
    OpenAI's JSON string), as SGLang prepares them for templates; the input is left untouched."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
            continue
        parsed_calls = []
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(arguments, str):
                parsed_calls.append(call)
                continue
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise LossMaskError(f"messages[{i}].tool_calls[{k}].function.arguments is not a JSON object: "
                                    f"{arguments[:60]!r}")
            parsed_calls.append({**call, "function": {**function, "arguments": value}})
        out.append({**message, "tool_calls": parsed_calls})
    return out


class DistillQwenSpanLocator(AssistantSpanLocator):
    """DeepSeek-R1-Distill-Qwen: `<｜Assistant｜>TEXT<｜end▁of▁sentence｜>`; after tool outputs the answer
    follows `<｜tool▁outputs▁end｜>` directly (no assistant marker), so both open a generated span."""

    end_token: ClassVar[str] = "<｜end▁of▁sentence｜>"
    tool_call_marker: ClassVar[str] = "<｜tool▁call▁begin｜>"
    openers: ClassVar[tuple[str, ...]] = ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>")
    forbidden_inside: ClassVar[tuple[str, ...]] = (
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁outputs▁end｜>",
        "<｜begin▁of▁sentence｜>",
    )

    @classmethod
    def control_tokens(cls) -> tuple[str, ...]:
        return tuple(dict.fromkeys((cls.end_token, *cls.openers, *cls.forbidden_inside)))

    def find_spans(self, text: str) -> list[CharSpan]:
        starts: list[tuple[int, str]] = []
        for opener in self.openers:
            pos = text.find(opener)
            while pos >= 0:
                starts.append((pos, opener))
                pos = text.find(opener, pos + len(opener))
        starts.sort()
        spans: list[CharSpan] = []
        for pos, opener in starts:
            body = pos + len(opener)
            finish = text.find(self.end_token, body)
            if finish < 0:
                if opener == "<｜tool▁outputs▁end｜>" and not text[body:].strip():
                    continue  # the conversation ends on tool outputs: nothing generated yet
                raise LossMaskError(f"{opener!r} at char {pos} is never closed by {self.end_token!r}")
            inside = text[body:finish]
            bad = [m for m in self.forbidden_inside if m in inside]
            if bad:
                raise LossMaskError(f"assistant span at char {body} contains {bad[0]!r}: ambiguous rendering")
            spans.append(CharSpan(body, finish + len(self.end_token)))
        return spans


_REGISTRY: dict[str, type[AssistantSpanLocator]] = {
    "qwen": ChatMLSpanLocator,
    "qwen3": Qwen3SpanLocator,
    "qwen3_5": Qwen35SpanLocator,
    "distill_qwen": DistillQwenSpanLocator,
}


def register_loss_mask_type(name: str, cls: type[AssistantSpanLocator]) -> None:
    """Add (or replace) a template type: `cls` locates assistant spans in that template's rendering."""
    if not (isinstance(cls, type) and issubclass(cls, AssistantSpanLocator)):
        raise TypeError("loss mask types must subclass AssistantSpanLocator")
    _REGISTRY[name] = cls


def loss_mask_types() -> list[str]:
    return sorted(_REGISTRY)


def locator_class(name: str) -> type[AssistantSpanLocator]:
    """The locator registered as `name`; `ValueError` names the known types otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown loss mask type {name!r}; known: {loss_mask_types()}") from None
