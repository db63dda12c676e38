"""Message path: tokens and loss mask re-derived from chat messages (the fallback when `turns` are absent).

The conversation is rendered once to text with the tokenizer's own chat template and tokenized once with
character offsets. Each template type knows where an assistant message's generated text sits in that
rendering (after the assistant header, through the end-of-turn token); those character spans become token
spans through the offsets. A span that cannot be found unambiguously, or a token that straddles a span
edge, raises `LossMaskError`: principle 2 forbids guessing.
"""

from __future__ import annotations

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
    "DistillQwenSpanLocator",
    "MultiTurnLossMaskGenerator",
    "register_loss_mask_type",
    "get_loss_mask_generator",
    "loss_mask_types",
]

Message = dict[str, Any]


class LossMaskError(ValueError):
    """The rendering does not let us say exactly which tokens the policy generated."""


@dataclass(frozen=True)
class CharSpan:
    """Half-open character range `[start, end)` of one assistant message's generated text."""

    start: int
    end: int


def _text_of(content: Any) -> str:
    """Message content as the templates render it (string, or the text parts of a list)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _assistant_messages(messages: Sequence[Message]) -> list[Message]:
    return [m for m in messages if m.get("role") == "assistant"]


class AssistantSpanLocator(ABC):
    """Knows one chat template's structure: where each assistant message's generated text is rendered."""

    #: the end-of-turn token the policy generates to close a message (masked 1)
    end_token: ClassVar[str]
    #: text that starts one rendered tool call inside an assistant span
    tool_call_marker: ClassVar[str]

    @abstractmethod
    def find_spans(self, text: str) -> list[CharSpan]:
        """Every assistant-generated span in `text`, in order; raise `LossMaskError` if ambiguous."""

    def locate(self, text: str, messages: Sequence[Message]) -> list[CharSpan]:
        """Spans matched one-to-one with the assistant messages, each checked against its message."""
        spans = self.find_spans(text)
        assistants = _assistant_messages(messages)
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
        answer = _text_of(message.get("content")).split("</think>")[-1].strip()
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
                spans.append(CharSpan(body + len(self.assistant_header), finish + len(end_tok)))
            pos = finish + len(end_tok)


class Qwen3SpanLocator(ChatMLSpanLocator):
    """Qwen3: ChatML plus `<think>` blocks. The template drops reasoning from turns before the last user
    query, so the mask covers exactly what the rendering contains (reasoning only where it is shown)."""


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
    "distill_qwen": DistillQwenSpanLocator,
}


def register_loss_mask_type(name: str, cls: type[AssistantSpanLocator]) -> None:
    """Add (or replace) a template type: `cls` locates assistant spans in that template's rendering."""
    if not (isinstance(cls, type) and issubclass(cls, AssistantSpanLocator)):
        raise TypeError("loss mask types must subclass AssistantSpanLocator")
    _REGISTRY[name] = cls


def loss_mask_types() -> list[str]:
    return sorted(_REGISTRY)


def get_loss_mask_generator(name: str, tokenizer: Any, **kwargs: Any) -> "MultiTurnLossMaskGenerator":
    """A generator for template type `name` (built in or registered)."""
    return MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=name, **kwargs)


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]) -> list[int]:
    """1 for tokens inside a span, 0 outside; a token crossing a span edge raises."""
    mask = [0] * len(offsets)
    first_tok: list[int | None] = [None] * len(spans)
    last_tok: list[int | None] = [None] * len(spans)
    k = 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and spans[k].end <= s:
            k += 1
        if k == len(spans):
            break
        span = spans[k]
        if span.start <= s and e <= span.end:
            mask[t] = 1
            if first_tok[k] is None:
                first_tok[k] = t
            last_tok[k] = t
        elif s < span.end and e > span.start:
            raise LossMaskError(
                f"token {t} (chars {s}..{e}) crosses the edge of assistant span {k} (chars {span.start}..{span.end}); "
                "the re-tokenized text merges generated and template text, no exact mask exists"
            )
    for k, span in enumerate(spans):
        ft, lt = first_tok[k], last_tok[k]
        if ft is None or lt is None or offsets[ft][0] != span.start or offsets[lt][1] != span.end:
            raise LossMaskError(f"assistant span {k} (chars {span.start}..{span.end}) is not covered by whole tokens")
    return mask


class MultiTurnLossMaskGenerator:
    """Tokens and loss mask of a whole conversation, exactly as the chat template renders it.

    `tokenizer_type` picks the template structure ("qwen", "qwen3", "distill_qwen", or a registered one).
    With `verify=True` the ids are checked against `apply_chat_template(..., tokenize=True)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_type: str = "qwen",
        *,
        verify: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            locator_cls = _REGISTRY[tokenizer_type]
        except KeyError:
            raise ValueError(f"unknown loss mask type {tokenizer_type!r}; known: {loss_mask_types()}") from None
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.locator = locator_cls()
        self.verify = verify
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.end_token_id: int = tokenizer.convert_tokens_to_ids(locator_cls.end_token)

    def render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the template renders it, without a generation prompt."""
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=False, **self.chat_template_kwargs
        )

    def get_text_and_spans(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[CharSpan]]:
        """Rendered text and the character span of every assistant message's generated part."""
        text = self.render(messages, tools)
        return text, self.locator.locate(text, messages)

    def get_loss_mask(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """`(token_ids, loss_mask)` over the whole conversation (prompt included, mask 0 there)."""
        if not messages:
            raise ValueError("no messages")
        text, spans = self.get_text_and_spans(messages, tools)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        token_ids: list[int] = list(enc["input_ids"])
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        mask = _mask_from_offsets(offsets, spans)
        if self.verify:
            reference = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=True, return_dict=False, **self.chat_template_kwargs
            )
            if list(reference) != token_ids:
                raise LossMaskError("tokenizing the rendered text does not reproduce apply_chat_template's ids")
        assert len(mask) == len(token_ids)
        return token_ids, mask

    def get_prompt_response(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """`(prompt_ids, response_ids, response_loss_mask)`; the prompt ends where the first assistant
        message's generated text begins (its header is prompt, as it was for the engine)."""
        token_ids, mask = self.get_loss_mask(messages, tools)
        split = next((i for i, m in enumerate(mask) if m), len(mask))
        return token_ids[:split], token_ids[split:], mask[split:]

    @staticmethod
    def get_response_lengths(loss_masks: Sequence[Sequence[int]]) -> list[int]:
        """slime's convention: the response runs from the first mask-1 token to the end."""
        lengths = []
        for mask in loss_masks:
            first = next((i for i, m in enumerate(mask) if m), len(mask))
            lengths.append(len(mask) - first)
        return lengths

    def get_text_from_loss_mask(self, token_ids: Sequence[int], loss_mask: Sequence[int]) -> list[str]:
        """Decoded text of each contiguous mask-1 run (for checks and debugging)."""
        runs: list[str] = []
        run: list[int] = []
        for tok, m in zip(token_ids, loss_mask):
            if m:
                run.append(tok)
            elif run:
                runs.append(self.tokenizer.decode(run))
                run = []
        if run:
            runs.append(self.tokenizer.decode(run))
        return runs
