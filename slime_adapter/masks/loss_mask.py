"""Message path: tokens and loss mask re-derived from chat messages (the fallback when `turns` are absent).

The conversation is rendered once to text with the tokenizer's own chat template and tokenized once with
character offsets. A span locator (`slime_adapter.masks.span_locators`, one per template type) says where each
assistant message's generated text sits in that rendering (after the assistant header, through the
end-of-turn token); those character spans become token spans through the offsets under one rule
(`slime_adapter.masks.token_spans`): a token trains only if every character of it is generated text. A token
that merges template and generated characters (e.g. the header's `\\n` and a generated leading `\\n` as one
`\\n\\n` token) is an *edge token*: mask 0, counted in `Encoding.edge_tokens`. A token straddling the start
of the first assistant span belongs to the prompt: the response begins at the first token that starts at
or after that span's first character, so `len(loss_mask) == response_length` holds by construction.

A message with slime's `step_loss_mask` set to anything but 1 trains nothing (its span stays in the
response, mask 0, and its edge tokens are not counted), as slime's own generator does.

Why the ids equal `apply_chat_template(messages, tools=..., tokenize=True)`: that call renders with the
same template function (`tokenize=False` returns exactly the text it would tokenize) and then tokenizes
the text with `tokenizer(text, add_special_tokens=False)` under the tokenizer's `split_special_tokens`
setting. We tokenize the same text the same way (straight through the Rust backend when its state is the
one that call would set, else through that very call). Edge tokens change only the mask, never the ids.
(`qwen3_5` first parses tool-call `arguments` JSON strings into mappings, as SGLang does before applying
a template; the ids then equal `apply_chat_template` of those prepared messages.) `verify` says how much
of that is re-checked:

- "cheap" (default): invariants costing a few percent of the build. Every control token the locator
  knows (`<|im_start|>`, `<|im_end|>`, ...) that is an added token appears in the ids exactly as often as
  in the text (special-token handling), each span's last whole token is the end-of-turn id, and the
  tokens touching each span (its mask-1 tokens and its edge tokens) decode to exactly the text their
  offsets cover (modulo the tokenizer's own normalizer), so edge tokens are checked as strictly as the
  rest.
- "full": the cheap checks plus a second, independent `apply_chat_template(..., tokenize=True)` compared
  token for token. It doubles the cost; tests and debugging use it.
- "off": no checks beyond what building the mask needs.

Refusal: `encode` raises `LossMaskError` (or the template's own error) for input that is not a chat this
template renders: text that does not parse as its structure (template control tokens inside message
text), a rendering that raises (a role the template rejects), a failed check. The sample builder never
lets that out: `slime_adapter.samples.message_path` turns it into a refused, zero-mask sample.

Compiled rendering (`slime_adapter.masks.chatml_render`): where the tokenizer's template is a ChatML template of
the Qwen2.5 family, a compiled renderer checked character for character against the Jinja template on a
probe corpus when the generator is built writes the text instead (Jinja stays the renderer for any template
that differs, and for any conversation outside what was checked).

Block cache: the rendering is cut right after every added control token it contains (`<|im_start|>`), and
each block is tokenized once and kept (least recently used evicted): a fast tokenizer splits its input at
added tokens before normalizing and pre-tokenizing, so the text tokenizes exactly as the concatenation of
its blocks. Blocks repeat a lot: the samples of one group share their whole prompt, and different prompts
share their system text and tool schemas, so only the new blocks (mostly the generated answers) are
tokenized, in one `encode_batch` call. The cut is only used where it is exact (the token is added, strips
no whitespace, matches as a whole and is no part of another added token, is matched before normalizing;
special tokens are not being split as text). The cheap checks still run over the joined ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_adapter.masks.chatml_render import ChatMLRenderer, verified_renderer
from slime_adapter.masks.control_tokens import added_control_ids, cut_tokens
from slime_adapter.masks.span_locators import (
    AssistantSpanLocator,
    CharSpan,
    ChatMLSpanLocator,
    DistillQwenSpanLocator,
    LossMaskError,
    Qwen3SpanLocator,
    Qwen35SpanLocator,
    assistant_messages,
    locator_class,
    loss_mask_types,
    register_loss_mask_type,
)
from slime_adapter.masks.token_spans import SpanTokens, is_sorted, mask_from_offsets, token_ranges
from slime_adapter.masks.verify import VERIFY_MODES, VerifyMode, verify_mode

__all__ = [
    "LossMaskError",
    "CharSpan",
    "AssistantSpanLocator",
    "ChatMLSpanLocator",
    "Qwen3SpanLocator",
    "Qwen35SpanLocator",
    "DistillQwenSpanLocator",
    "Encoding",
    "MultiTurnLossMaskGenerator",
    "VERIFY_MODES",
    "VerifyMode",
    "register_loss_mask_type",
    "get_loss_mask_generator",
    "cached_loss_mask_generator",
    "loss_mask_types",
]

Message = dict[str, Any]
_Block = tuple[list[int], list[int], list[int]]  # a block's ids, and char starts and ends within it


def get_loss_mask_generator(name: str, tokenizer: Any, **kwargs: Any) -> "MultiTurnLossMaskGenerator":
    """A generator for template type `name` (built in or registered)."""
    return MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=name, **kwargs)


@dataclass(frozen=True)
class Encoding:
    """One conversation's ids and mask. `response_start`: the first response token (the prompt is
    `ids[:response_start]`); `edge_tokens`: tokens of trained spans that the edge rule set to 0;
    `spans`: each assistant span's tokens (inner, touching, edges)."""

    ids: list[int]
    mask: list[int]
    spans: SpanTokens
    edge_tokens: int
    response_start: int


class MultiTurnLossMaskGenerator:
    """Tokens and loss mask of a whole conversation, exactly as the chat template renders it.

    `tokenizer_type` picks the template structure ("qwen", "qwen3", "qwen3_5", "distill_qwen", or a
    registered one).
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
        block_cache_size: int = 4096,
        compiled_render: bool = True,
    ) -> None:
        locator_cls = locator_class(tokenizer_type)
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.locator = locator_cls()
        self.verify: str = verify_mode(verify)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.end_token_id: int = tokenizer.convert_tokens_to_ids(locator_cls.end_token)
        # the Rust tokenizer behind a fast tokenizer: calling it directly skips ~0.1 ms of Python per call
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._control_ids = added_control_ids(tokenizer, locator_cls.control_tokens())
        self._end_is_added = any(name == locator_cls.end_token for name, _ in self._control_ids)
        self._cut_tokens = cut_tokens(tokenizer, self._control_ids)
        #: rendered blocks kept tokenized (0: no cache, every text tokenized whole); may be changed any time
        self.block_cache_size = max(0, int(block_cache_size))
        # block text -> (ids, char starts, char ends) relative to the block; least recently used evicted
        self._block_cache: OrderedDict[str, _Block] = OrderedDict()
        self._block_lock = threading.Lock()
        # a compiled renderer proven equal to this tokenizer's Jinja template (None: Jinja renders everything)
        self._template: Any = getattr(tokenizer, "chat_template", None)
        self.compiled: ChatMLRenderer | None = (
            verified_renderer(tokenizer) if compiled_render and not self.chat_template_kwargs else None)

    def prepare_messages(self, messages: Sequence[Message]) -> list[Message]:
        """The messages as the serving engine hands them to the template (see the locator's
        `prepare_messages`); `render` and the "full" check use these."""
        return self.locator.prepare_messages(messages)

    def render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the template renders it (messages already prepared), without a generation
        prompt. The compiled renderer writes it where it was proven equal to the template, else Jinja."""
        if self.compiled is not None and self.tokenizer.chat_template is self._template:
            text = self.compiled.render(messages, tools)
            if text is not None:
                return text
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=False, **self.chat_template_kwargs
        )

    def get_text_and_spans(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[CharSpan]]:
        """Rendered text and the character span of every assistant message's generated part."""
        prepared = self.prepare_messages(messages)
        text = self.render(prepared, tools)
        return text, self.locator.locate(text, prepared)

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

    def _block_bounds(self, text: str) -> list[int]:
        """Offsets right after each cut token in `text` (see the module docstring); none when the block
        cache is off or cannot be exact."""
        if not self._cut_tokens or self.block_cache_size <= 0:
            return []
        if getattr(self.tokenizer, "split_special_tokens", False):
            return []
        bounds: set[int] = set()
        for name in self._cut_tokens:
            at = text.find(name)
            while at >= 0:
                end = at + len(name)
                if end < len(text):
                    bounds.add(end)
                at = text.find(name, end)
        return sorted(bounds)

    def clear_block_cache(self) -> None:
        """Forget cached block tokenizations (benchmarks start cold)."""
        with self._block_lock:
            self._block_cache.clear()

    def _tokenize_blocks(self, blocks: list[str]) -> list[_Block]:
        """Each block's tokens, from the cache where it can; the rest in one batch call, then kept."""
        with self._block_lock:
            found: list[_Block | None] = []
            for block in blocks:
                hit = self._block_cache.get(block)
                if hit is not None:
                    self._block_cache.move_to_end(block)
                found.append(hit)
        missing = list(dict.fromkeys(block for block, entry in zip(blocks, found) if entry is None))
        if missing:
            made: dict[str, _Block] = {}
            for block, encoding in zip(missing, self._backend.encode_batch(missing, add_special_tokens=False)):
                offsets = encoding.offsets
                made[block] = (encoding.ids, [o[0] for o in offsets], [o[1] for o in offsets])
            found = [made[block] if entry is None else entry for block, entry in zip(blocks, found)]
            with self._block_lock:
                self._block_cache.update(made)
                while len(self._block_cache) > self.block_cache_size:
                    self._block_cache.popitem(last=False)
        return found  # type: ignore[return-value]

    def _tokenize_cached(self, text: str) -> tuple[list[int], list[int], list[int]]:
        """`(ids, starts, ends)` of `text`, block by block through the block cache where that is exact."""
        bounds = self._block_bounds(text) if self._backend_matches_call() else []
        if not bounds:
            ids, offsets = self.tokenize(text)
            if len(offsets) != len(ids):
                raise LossMaskError(f"{len(ids)} ids but {len(offsets)} offsets")
            return ids, [o[0] for o in offsets], [o[1] for o in offsets]
        edges = [0, *bounds, len(text)]
        blocks = [text[a:b] for a, b in zip(edges, edges[1:])]
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for base, (block_ids, block_starts, block_ends) in zip(edges, self._tokenize_blocks(blocks)):
            ids += block_ids
            starts += map(base.__add__, block_starts) if base else block_starts  # map: no Python frame per id
            ends += map(base.__add__, block_ends) if base else block_ends
        return ids, starts, ends

    def _decode(self, pieces: list[list[int]]) -> list[str]:
        if self._backend is not None and hasattr(self._backend, "decode"):
            # one call per piece: decode_batch's thread pool costs more than it saves on a few short pieces
            return [self._backend.decode(p, skip_special_tokens=False) for p in pieces]
        return [self.tokenizer.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False) for p in pieces]

    def _normalized(self, text: str) -> str:
        normalizer = getattr(self._backend, "normalizer", None)
        return normalizer.normalize_str(text) if normalizer is not None else text

    def _check_cheap(self, text: str, ids: list[int], starts: list[int], ends: list[int],
                     tokens: SpanTokens) -> None:
        """The invariants of the "cheap" mode (see the module docstring); raise `LossMaskError`."""
        for name, token_id in self._control_ids:
            in_text, in_ids = text.count(name), ids.count(token_id)
            if in_text != in_ids:
                raise LossMaskError(f"{name!r} occurs {in_text} time(s) in the rendered text but its id {token_id} "
                                    f"{in_ids} time(s) in the tokens: special tokens are not handled as the "
                                    "chat template's tokenization handles them")
        if self._end_is_added:
            for k, (first, stop) in enumerate(tokens.inner):
                if stop == first or ids[stop - 1] != self.end_token_id:
                    raise LossMaskError(f"assistant span {k} does not end with the end-of-turn id {self.end_token_id}")
        decoded = self._decode([ids[lo:hi] for lo, hi in tokens.touch])
        for k, ((lo, hi), got) in enumerate(zip(tokens.touch, decoded)):
            want = text[starts[lo]:ends[hi - 1]] if hi > lo else None
            if want is None or (got != want and got != self._normalized(want)):
                raise LossMaskError(f"the tokens of assistant span {k} (edge tokens included) decode to "
                                    f"{got[:60]!r}, not to the text they cover {(want or '')[:60]!r}")

    def encode(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> Encoding:
        """Ids, mask, edge-token count and prompt/response split of the whole conversation (module
        docstring); raises `LossMaskError` (or the template's own error) for input it cannot render and
        locate exactly."""
        if not messages:
            raise LossMaskError("no messages")
        prepared = self.prepare_messages(messages)
        text = self.render(prepared, tools)
        spans = self.locator.locate(text, prepared)
        ids, starts, ends = self._tokenize_cached(text)
        if is_sorted(starts) and is_sorted(ends):
            tokens = token_ranges(starts, ends, spans)
        else:  # overlapping offsets: the general token-by-token mapping
            tokens = mask_from_offsets(list(zip(starts, ends)), spans)
        trained = [m.get("step_loss_mask", 1) == 1 for m in assistant_messages(prepared)]
        if self.verify != "off":
            self._check_cheap(text, ids, starts, ends, tokens)
        if self.verify == "full":
            reference = self.tokenizer.apply_chat_template(
                prepared, tools=tools, tokenize=True, return_dict=False, **self.chat_template_kwargs
            )
            if list(reference) != ids:
                raise LossMaskError("tokenizing the rendered text does not reproduce apply_chat_template's ids")
        return Encoding(ids=ids, mask=tokens.mask(len(ids), trained), spans=tokens,
                        edge_tokens=tokens.edge_count(trained),
                        response_start=tokens.inner[0][0] if spans else len(ids))

    def get_loss_mask(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """`(token_ids, loss_mask)` over the whole conversation (prompt included, mask 0 there)."""
        encoded = self.encode(messages, tools)
        return encoded.ids, encoded.mask

    def get_prompt_response(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """`(prompt_ids, response_ids, response_loss_mask)`; the prompt ends where the first assistant
        message's generated text begins (its header is prompt, as it was for the engine; a token that
        straddles that point is prompt too)."""
        encoded = self.encode(messages, tools)
        split = encoded.response_start
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
    mode = verify_mode(verify)
    cls = locator_class(name)
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
