"""Message path: tokens and loss mask re-derived from chat messages (the fallback when `turns` are absent).

The conversation is rendered once to text with the tokenizer's own chat template and tokenized once with
character offsets. Each template type knows where an assistant message's generated text sits in that
rendering (after the assistant header, through the end-of-turn token); those character spans become token
spans through the offsets. A span that cannot be found unambiguously, or a token that straddles a span
edge, raises `LossMaskError`: principle 2 forbids guessing.

Why the ids equal `apply_chat_template(messages, tools=..., tokenize=True)`: that call renders with the
same template function (`tokenize=False` returns exactly the text it would tokenize) and then tokenizes
the text with `tokenizer(text, add_special_tokens=False)` under the tokenizer's `split_special_tokens`
setting. We tokenize the same text the same way (straight through the Rust backend when its state is the
one that call would set, else through that very call). `verify` says how much of that is re-checked:

- "cheap" (default): invariants costing a few percent of the build. Every control token the locator
  knows (`<|im_start|>`, `<|im_end|>`, ...) that is an added token appears in the ids exactly as often as
  in the text (special-token handling), offsets are monotone and end at the text's end, every span starts
  and ends on a token boundary and ends with the end-of-turn id, and the mask-1 tokens of each span decode
  to exactly the span's text (modulo the tokenizer's own normalizer).
- "full": the cheap checks plus a second, independent `apply_chat_template(..., tokenize=True)` compared
  token for token. It doubles the cost; tests and debugging use it.
- "off": no checks beyond what building the mask needs (span edges on token boundaries).

Prompt cache: the samples of one group share their prompt (system text, tool schemas, the task), so the
rendering up to the first assistant block's opener is tokenized once per group, not once per record. The
cut is made right after an added control token (`<|im_start|>`): a fast tokenizer splits its input at added
tokens before normalizing and pre-tokenizing, so each side tokenizes exactly as inside the whole text. The
cut is only used where that holds (the token is added, strips no whitespace, matches as a whole and is no
part of another added token, is matched before normalizing; special tokens are not being split as text).
The cheap checks still run over the joined ids.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from operator import le
from typing import Any, ClassVar, Literal

__all__ = [
    "LossMaskError",
    "CharSpan",
    "AssistantSpanLocator",
    "ChatMLSpanLocator",
    "Qwen3SpanLocator",
    "DistillQwenSpanLocator",
    "MultiTurnLossMaskGenerator",
    "VERIFY_MODES",
    "VerifyMode",
    "register_loss_mask_type",
    "get_loss_mask_generator",
    "cached_loss_mask_generator",
    "loss_mask_types",
]

Message = dict[str, Any]
VerifyMode = Literal["cheap", "full", "off"]
VERIFY_MODES: tuple[str, ...] = ("cheap", "full", "off")


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

    @classmethod
    def control_tokens(cls) -> tuple[str, ...]:
        """Template control strings; those that are added tokens of the tokenizer must each become exactly
        one id per occurrence (the cheap check of special-token handling)."""
        return (cls.end_token,)

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

    @classmethod
    def control_tokens(cls) -> tuple[str, ...]:
        return (cls.start_token, cls.end_token)

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


def _crossing_error(token: int, start: int, end: int, index: int, span: CharSpan) -> LossMaskError:
    return LossMaskError(
        f"token {token} (chars {start}..{end}) crosses the edge of assistant span {index} "
        f"(chars {span.start}..{span.end}); the re-tokenized text merges generated and template text, "
        "no exact mask exists"
    )


def _mask_from_offsets(
    offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]
) -> tuple[list[int], list[tuple[int, int]]]:
    """1 for tokens inside a span, 0 outside, and each span's `[first, stop)` tokens; a token crossing a
    span edge raises. One pass over every token: the general fallback for offsets that are not monotone."""
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
            raise _crossing_error(t, s, e, k, span)
    ranges: list[tuple[int, int]] = []
    for k, span in enumerate(spans):
        ft, lt = first_tok[k], last_tok[k]
        if ft is None or lt is None or offsets[ft][0] != span.start or offsets[lt][1] != span.end:
            raise LossMaskError(f"assistant span {k} (chars {span.start}..{span.end}) is not covered by whole tokens")
        ranges.append((ft, lt + 1))
    return mask, ranges


def _is_sorted(values: list[int]) -> bool:
    return all(map(le, values, islice(values, 1, None)))


def _token_ranges(starts: list[int], ends: list[int], spans: Sequence[CharSpan]) -> list[tuple[int, int]]:
    """`[first, stop)` token range of each span, by bisection over monotone offsets (O(spans * log n)
    instead of a Python loop over every token); same errors as `_mask_from_offsets`."""
    ranges: list[tuple[int, int]] = []
    for k, span in enumerate(spans):
        first = bisect_left(starts, span.start)
        stop = bisect_left(starts, span.end, first)
        if first > 0 and ends[first - 1] > span.start:  # the token before starts outside, ends inside
            raise _crossing_error(first - 1, starts[first - 1], ends[first - 1], k, span)
        if stop > first and ends[stop - 1] > span.end:  # the last token starts inside, ends outside
            raise _crossing_error(stop - 1, starts[stop - 1], ends[stop - 1], k, span)
        if stop == first or starts[first] != span.start or ends[stop - 1] != span.end:
            raise LossMaskError(f"assistant span {k} (chars {span.start}..{span.end}) is not covered by whole tokens")
        ranges.append((first, stop))
    return ranges


def _verify_mode(verify: bool | str | None) -> str:
    """`True` keeps its old meaning (the full re-render), `False`/`None` mean "off"."""
    if verify is True:
        return "full"
    if verify is False or verify is None:
        return "off"
    if verify in VERIFY_MODES:
        return str(verify)
    raise ValueError(f"verify must be one of {VERIFY_MODES} (or a bool), got {verify!r}")


def _added_control_ids(tokenizer: Any, names: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """`(text, id)` of each control string that is an added token matched wherever it occurs."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return ()
    by_content = {getattr(tok, "content", str(tok)): (i, tok) for i, tok in decoder.items()}
    found = []
    for name in dict.fromkeys(names):
        hit = by_content.get(name)
        if hit is not None and not getattr(hit[1], "single_word", False):
            found.append((name, int(hit[0])))
    return tuple(found)


def _cut_tokens(tokenizer: Any, control_ids: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """Control tokens after which the text can be cut without changing its tokenization."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return ()
    contents = [getattr(tok, "content", str(tok)) for tok in decoder.values()]
    usable = []
    for name, token_id in control_ids:
        tok = decoder.get(token_id)
        if tok is None or any(getattr(tok, flag, True) for flag in ("lstrip", "rstrip", "normalized")):
            continue  # it could take whitespace from the other side, or match only after normalizing
        if any(name in other and other != name for other in contents):
            continue  # a longer added token could swallow it in the whole text
        usable.append(name)
    return tuple(usable)


@dataclass(frozen=True)
class _Encoded:
    """One conversation's ids, mask, and each assistant span's `[first, stop)` token range."""

    ids: list[int]
    mask: list[int]
    ranges: list[tuple[int, int]]


class MultiTurnLossMaskGenerator:
    """Tokens and loss mask of a whole conversation, exactly as the chat template renders it.

    `tokenizer_type` picks the template structure ("qwen", "qwen3", "distill_qwen", or a registered one).
    `verify` is "cheap" (default), "full" (also re-render with `apply_chat_template(..., tokenize=True)`
    and compare) or "off"; see the module docstring. `True`/`False` mean "full"/"off".
    """

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_type: str = "qwen",
        *,
        verify: bool | str = "cheap",
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_cache_size: int = 32,
    ) -> None:
        try:
            locator_cls = _REGISTRY[tokenizer_type]
        except KeyError:
            raise ValueError(f"unknown loss mask type {tokenizer_type!r}; known: {loss_mask_types()}") from None
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.locator = locator_cls()
        self.verify: str = _verify_mode(verify)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.end_token_id: int = tokenizer.convert_tokens_to_ids(locator_cls.end_token)
        # the Rust tokenizer behind a fast tokenizer: calling it directly skips ~0.1 ms of Python per call
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._control_ids = _added_control_ids(tokenizer, locator_cls.control_tokens())
        self._end_is_added = any(name == locator_cls.end_token for name, _ in self._control_ids)
        self._cut_tokens = _cut_tokens(tokenizer, self._control_ids)
        #: prompts kept tokenized (0: no prompt cache); may be changed at any time
        self.prompt_cache_size = max(0, int(prompt_cache_size))
        # prompt text -> (ids, char starts, char ends): a few groups' prompts, least recently used evicted
        self._prompt_cache: OrderedDict[str, tuple[list[int], list[int], list[int]]] = OrderedDict()
        self._prompt_lock = threading.Lock()

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

    def _backend_matches_call(self) -> bool:
        """Whether the backend is in the state `tokenizer(text, add_special_tokens=False)` would put it in
        (no truncation, no padding, special tokens split per `split_special_tokens`)."""
        backend = self._backend
        if backend is None or not hasattr(backend, "encode"):
            return False
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        return (backend.truncation is None and backend.padding is None
                and bool(getattr(backend, "encode_special_tokens", False)) == split)

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`(ids, char offsets)` of `text`, tokenized as `apply_chat_template(..., tokenize=True)` does."""
        if self._backend_matches_call():
            encoding = self._backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets
        # transformers' own call (it also resets the backend, so the next call takes the direct route)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _prompt_cut(self, text: str, first_span_start: int) -> int:
        """Where the cached prompt ends: right after the last cut token before the first generated span;
        0 when the cache cannot be used exactly."""
        if not self._cut_tokens or self.prompt_cache_size <= 0:
            return 0
        if getattr(self.tokenizer, "split_special_tokens", False):
            return 0
        cut = 0
        for name in self._cut_tokens:
            at = text.rfind(name, 0, first_span_start)
            if at >= 0:
                cut = max(cut, at + len(name))
        return cut

    def clear_prompt_cache(self) -> None:
        """Forget cached prompt tokenizations (benchmarks start cold)."""
        with self._prompt_lock:
            self._prompt_cache.clear()

    def _prompt_tokens(self, prompt: str) -> tuple[list[int], list[int], list[int]]:
        with self._prompt_lock:
            hit = self._prompt_cache.get(prompt)
            if hit is not None:
                self._prompt_cache.move_to_end(prompt)
                return hit
        encoding = self._backend.encode(prompt, add_special_tokens=False)
        entry = (encoding.ids, [o[0] for o in encoding.offsets], [o[1] for o in encoding.offsets])
        with self._prompt_lock:
            self._prompt_cache[prompt] = entry
            while len(self._prompt_cache) > self.prompt_cache_size:
                self._prompt_cache.popitem(last=False)
        return entry

    def _tokenize_with_prompt_cache(self, text: str, spans: Sequence[CharSpan]
                                    ) -> tuple[list[int], list[int], list[int]]:
        """`(ids, starts, ends)` of `text`; the prompt part comes from the cache when it can."""
        backend_ok = self._backend_matches_call()
        cut = self._prompt_cut(text, spans[0].start) if spans and backend_ok else 0
        if cut:
            prompt_ids, prompt_starts, prompt_ends = self._prompt_tokens(text[:cut])
            rest = self._backend.encode(text[cut:], add_special_tokens=False)
            offsets = rest.offsets
            return (prompt_ids + rest.ids, prompt_starts + [o[0] + cut for o in offsets],
                    prompt_ends + [o[1] + cut for o in offsets])
        ids, offsets = self.tokenize(text)
        if len(offsets) != len(ids):
            raise LossMaskError(f"{len(ids)} ids but {len(offsets)} offsets")
        return ids, [o[0] for o in offsets], [o[1] for o in offsets]

    def _decode(self, pieces: list[list[int]]) -> list[str]:
        if self._backend is not None and hasattr(self._backend, "decode"):
            # one call per piece: decode_batch's thread pool costs more than it saves on a few short pieces
            return [self._backend.decode(p, skip_special_tokens=False) for p in pieces]
        return [self.tokenizer.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False) for p in pieces]

    def _normalized(self, text: str) -> str:
        normalizer = getattr(self._backend, "normalizer", None)
        return normalizer.normalize_str(text) if normalizer is not None else text

    def _check_cheap(self, text: str, ids: list[int], spans: Sequence[CharSpan],
                     ranges: Sequence[tuple[int, int]]) -> None:
        """The invariants of the "cheap" mode (see the module docstring); raise `LossMaskError`."""
        for name, token_id in self._control_ids:
            in_text, in_ids = text.count(name), ids.count(token_id)
            if in_text != in_ids:
                raise LossMaskError(f"{name!r} occurs {in_text} time(s) in the rendered text but its id {token_id} "
                                    f"{in_ids} time(s) in the tokens: special tokens are not handled as the "
                                    "chat template's tokenization handles them")
        if self._end_is_added:
            for k, (_, stop) in enumerate(ranges):
                if ids[stop - 1] != self.end_token_id:
                    raise LossMaskError(f"assistant span {k} does not end with the end-of-turn id {self.end_token_id}")
        decoded = self._decode([ids[first:stop] for first, stop in ranges])
        for k, (span, got) in enumerate(zip(spans, decoded)):
            want = text[span.start:span.end]
            if got != want and got != self._normalized(want):
                raise LossMaskError(f"the mask-1 tokens of assistant span {k} decode to {got[:60]!r}, "
                                    f"not to the span's text {want[:60]!r}")

    def _encode(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> _Encoded:
        if not messages:
            raise ValueError("no messages")
        text, spans = self.get_text_and_spans(messages, tools)
        ids, starts, ends = self._tokenize_with_prompt_cache(text, spans)
        mask = [0] * len(ids)
        if _is_sorted(starts) and _is_sorted(ends):
            ranges = _token_ranges(starts, ends, spans)
            for first, stop in ranges:
                mask[first:stop] = [1] * (stop - first)
        else:  # overlapping offsets: the general token-by-token mapping
            mask, ranges = _mask_from_offsets(list(zip(starts, ends)), spans)
        if self.verify != "off":
            self._check_cheap(text, ids, spans, ranges)
        if self.verify == "full":
            reference = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=True, return_dict=False, **self.chat_template_kwargs
            )
            if list(reference) != ids:
                raise LossMaskError("tokenizing the rendered text does not reproduce apply_chat_template's ids")
        return _Encoded(ids=ids, mask=mask, ranges=ranges)

    def get_loss_mask(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """`(token_ids, loss_mask)` over the whole conversation (prompt included, mask 0 there)."""
        encoded = self._encode(messages, tools)
        return encoded.ids, encoded.mask

    def get_prompt_response(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """`(prompt_ids, response_ids, response_loss_mask)`; the prompt ends where the first assistant
        message's generated text begins (its header is prompt, as it was for the engine)."""
        encoded = self._encode(messages, tools)
        split = encoded.ranges[0][0] if encoded.ranges else len(encoded.ids)
        return encoded.ids[:split], encoded.ids[split:], encoded.mask[split:]

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
        return [self.tokenizer.decode(list(token_ids[a:b])) for a, b in _runs(loss_mask)]


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """`[start, stop)` of each contiguous mask-1 run."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


_GENERATORS: dict[tuple[int, str, type[AssistantSpanLocator], str], tuple[Any, MultiTurnLossMaskGenerator]] = {}
_GENERATORS_LOCK = threading.Lock()
_GENERATORS_MAX = 32


def cached_loss_mask_generator(name: str, tokenizer: Any, verify: bool | str = "cheap") -> MultiTurnLossMaskGenerator:
    """One generator per (tokenizer, template type, verify mode): building samples record by record
    then resolves control-token ids and added-token tables once, not per record."""
    mode = _verify_mode(verify)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown loss mask type {name!r}; known: {loss_mask_types()}")
    key = (id(tokenizer), name, cls, mode)
    hit = _GENERATORS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    generator = MultiTurnLossMaskGenerator(tokenizer, name, verify=mode)
    with _GENERATORS_LOCK:
        if len(_GENERATORS) >= _GENERATORS_MAX:
            _GENERATORS.clear()
        _GENERATORS[key] = (tokenizer, generator)  # the tokenizer is kept so its id cannot be reused
    return generator
