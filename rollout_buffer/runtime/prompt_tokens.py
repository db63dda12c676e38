"""Token-exact prompts for multi-turn rollouts.

The first prompt is the chat template's rendering of the messages. Every later prompt is the previous
prompt + the model's own output ids + the tokens of only the newly appended messages, so a turn's prompt
always extends the previous one exactly and re-tokenizing the model's output can never drift.

The new messages' tokens are the template's own text for them: the conversation is rendered with the last
assistant message replaced by a sentinel, and everything after the sentinel (the template's end of the
assistant turn, the new messages, the generation prompt) is tokenized. When the model's output already
ends with the turn-closing token the template writes (`<|im_end|>` for ChatML), that token is not repeated.

Encoding is the expensive part (the Qwen pre-tokenizer regex costs ~0.7 us per character in `tokenizers`,
and every rollout's first prompt repeats the same system prompt and tool schemas), so `PieceEncoder`
encodes text piece by piece between the tokenizer's own added tokens, caches long pieces, and encodes
plain-ASCII pieces of the Qwen tokenizer family with the same pre-tokenizer rule in Python's `re` plus a
word cache (`AsciiWords`). Both are exact, not approximations: a fast tokenizer itself cuts the text at
every added token first and encodes the pieces between them independently, and on ASCII text the
pre-tokenizer's character classes have one meaning; each is checked against the tokenizer when it is set up.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import threading
from collections import OrderedDict
from typing import Any

from rollout_buffer.tasks.contract import HistoryRewriteError

log = logging.getLogger(__name__)

SENTINEL = "\u2063<rollout-buffer-assistant-sentinel>\u2063"

# Pieces shorter than this are encoded each time (cheaply, word by word) rather than cached whole.
MIN_CACHED_CHARS = 128
# The cache's size bound, in characters of cached text (the ids take a few times as many bytes).
CACHE_CHARS = 4_000_000
# A piece longer than this is never cached: it would evict everything else for one use.
MAX_CACHED_CHARS = 200_000


@functools.lru_cache(maxsize=32)
def added_token_texts(tokenizer: Any) -> dict[int, str]:
    """id -> text of the tokenizer's added tokens (the turn-closing tokens are among them); once per tokenizer."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(token, "content", token)) for i, token in decoder.items()}


# The pre-tokenizer pattern of Qwen2, Qwen2.5, Qwen3 and DeepSeek-R1-Distill-Qwen tokenizers.
QWEN_PRETOKENIZER = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# The same rule, spelled for text of printable ASCII, tab, CR and LF only, where \p{L} is [A-Za-z], \p{N} is
# [0-9] and \s is [ \t\r\n] in every regex engine.
_QWEN_ASCII = re.compile(
    r"""'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"""
    r"""| ?[^ \t\r\nA-Za-z0-9]+[\r\n]*|[ \t\r\n]*[\r\n]+|[ \t\r\n]+(?![^ \t\r\n])|[ \t\r\n]+""")
_NOT_PLAIN_ASCII = re.compile(r"[^\t\n\r\x20-\x7e]")
_WORD_CACHE_MAX = 100_000


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


class AsciiWords:
    """Qwen-family BPE for plain-ASCII text: pre-tokenize with `_QWEN_ASCII`, map bytes to the byte-level
    alphabet, and look each word up in a cache filled by the tokenizer's own BPE model."""

    def __init__(self, backend: Any) -> None:
        self._tokenize = backend.model.tokenize
        self._alphabet = str.maketrans({chr(b): c for b, c in _byte_level_alphabet().items() if b < 128})
        self._words: dict[str, tuple[int, ...]] = {}

    @classmethod
    def for_backend(cls, backend: Any) -> AsciiWords | None:
        """An instance when `backend` is a Qwen-family tokenizer (and agrees on a test corpus), else None."""
        try:
            pre = repr(backend.pre_tokenizer)
            normalizer = repr(backend.normalizer) if backend.normalizer is not None else "None"
            model = backend.model
        except AttributeError:
            return None
        expected = (f'Sequence(pretokenizers=[Split(pattern=Regex("{QWEN_PRETOKENIZER}"), behavior=Isolated, '
                    'invert=False), ByteLevel(add_prefix_space=False, ')
        if not (pre.startswith(expected) and pre.endswith("use_regex=False)])")):
            return None
        if normalizer not in ("NFC()", "None") or type(model).__name__ != "BPE" or getattr(model, "dropout", None):
            return None
        if any(getattr(t, "normalized", True) for t in backend.get_added_tokens_decoder().values()):
            return None  # such tokens are matched inside pieces; leave that to the tokenizer
        words = cls(backend)
        return words if words._agrees(backend) else None

    def _agrees(self, backend: Any) -> bool:
        rng = random.Random(7)
        alphabet = "aZ9 \n\t\r'sStTlLdDmMvVrReE.,!?-_(){}[]<>:;\"#$%&*+/=@\\^`|~0"
        corpus = ["don't", "I'LL", "x's", "a   b", "  \n\n  ", "?\n\n", "$1,000.00!", "\r\n", "end  ", "\t\tx",
                  "user\nWhat is 3 + 24?", '{"name": "calculator"}']
        corpus += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
        return all(self.encode(text) == list(backend.encode(text, add_special_tokens=False).ids) for text in corpus)

    @staticmethod
    def handles(text: str) -> bool:
        return text.isascii() and _NOT_PLAIN_ASCII.search(text) is None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        words = self._words
        for word in _QWEN_ASCII.findall(text):
            cached = words.get(word)
            if cached is None:
                cached = tuple(token.id for token in self._tokenize(word.translate(self._alphabet)))
                if len(words) >= _WORD_CACHE_MAX:
                    words.clear()
                words[word] = cached
            ids.extend(cached)
        return ids


class PieceEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)`, with the text between added tokens cached.

    A fast tokenizer first splits its input at every occurrence of a (non-normalized) added token, leftmost
    longest, and then normalizes, pre-tokenizes and encodes each piece on its own. Doing that split here,
    with the same rule, gives the same ids, and the pieces that recur (the system prompt with its tool
    schemas, template scaffolding) come from a cache. Tokenizers where that equivalence is not certain (an
    added token that strips whitespace or matches single words only, truncation or padding enabled, no fast
    backend) are encoded whole, and a self-check against whole-text encoding runs once at construction.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._ids_of: dict[str, int] = {}
        self._split: re.Pattern[str] | None = None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self._words: AsciiWords | None = None
        self.hits = 0
        self.misses = 0
        if backend is not None:
            self._split = self._split_pattern(backend)
            if self._split is not None:
                self._words = AsciiWords.for_backend(backend)
            if self._split is not None and not self._self_check():
                log.warning("piecewise encoding disagrees with %s; encoding whole texts", type(tokenizer).__name__)
                self._split = None
                self._words = None

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    def _split_pattern(self, backend: Any) -> re.Pattern[str] | None:
        if getattr(backend, "truncation", None) or getattr(backend, "padding", None):
            return None
        if getattr(backend, "encode_special_tokens", False):  # added tokens are not split out at all
            return None
        try:
            added = backend.get_added_tokens_decoder()
        except AttributeError:
            return None
        for token_id, token in added.items():
            if getattr(token, "normalized", True):
                continue  # matched inside the pieces, after normalization, exactly as the tokenizer does
            if token.lstrip or token.rstrip or token.single_word:
                return None
            self._ids_of[str(token.content)] = int(token_id)
        if not self._ids_of:
            return None
        # Longest first: Python's alternation takes the first alternative that matches at the leftmost
        # position, which then is the longest, as the tokenizer's leftmost-longest matcher does.
        contents = sorted(self._ids_of, key=len, reverse=True)
        return re.compile("|".join(re.escape(c) for c in contents))

    def _self_check(self) -> bool:
        bits = [" hello", "a\n", "x  \n\n", "\u00e9t\u00e9 \u4f60\u597d", "1 + 2 = 3", "  ", "",
                "a longer piece of text, long enough to be cached"]
        tokens = sorted(self._ids_of)
        probe = "".join(bits[i % len(bits)] + token for i, token in enumerate(tokens)) + " tail"
        return all(self.encode(text) == self._whole(text) for text in (probe, probe, "".join(tokens), "plain"))

    def _whole(self, text: str) -> list[int]:
        if self._backend is not None:  # the same ids as tokenizer.encode, without its Python overhead
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        split = self._split
        if split is None:
            return self._whole(text)
        ids: list[int] = []
        pos = 0
        for match in split.finditer(text):
            start = match.start()
            if start > pos:
                ids.extend(self._piece(text[pos:start]))
            ids.append(self._ids_of[match.group()])
            pos = match.end()
        if pos < len(text):
            ids.extend(self._piece(text[pos:]))
        return ids

    def _uncached(self, piece: str) -> list[int]:
        if self._words is not None and AsciiWords.handles(piece):
            return self._words.encode(piece)
        return self._whole(piece)

    def _piece(self, piece: str) -> tuple[int, ...] | list[int]:
        if len(piece) < MIN_CACHED_CHARS or len(piece) > MAX_CACHED_CHARS:
            return self._uncached(piece)
        cached = self._cache.get(piece)
        if cached is not None:
            self.hits += 1
            with self._lock:
                if piece in self._cache:
                    self._cache.move_to_end(piece)
            return cached
        self.misses += 1
        ids = tuple(self._uncached(piece))
        with self._lock:
            if piece not in self._cache:
                self._cache[piece] = ids
                self._cached_chars += len(piece)
                while self._cached_chars > CACHE_CHARS and self._cache:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids


@functools.lru_cache(maxsize=32)
def piece_encoder(tokenizer: Any) -> PieceEncoder:
    """One shared encoder (and cache) per tokenizer and process."""
    return PieceEncoder(tokenizer)


class PromptTokens:
    """Renders and tokenizes one rollout's conversation with one tokenizer and tool list."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._added = added_token_texts(tokenizer)
        self._encoder = piece_encoder(tokenizer)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text)

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation_text(self, before_assistant: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                          last_output_ids: list[int]) -> str:
        """The template's text after the model's last output, through the new messages and generation prompt."""
        stub = {"role": "assistant", "content": SENTINEL}
        full = self.render([*before_assistant, stub, *new_messages], add_generation_prompt=True)
        at = full.find(SENTINEL)
        if at < 0 or full.find(SENTINEL, at + 1) >= 0:
            raise HistoryRewriteError("the chat template does not render assistant content verbatim exactly once; "
                                      "token-exact continuation is impossible with it")
        glue = full[at + len(SENTINEL):]
        if last_output_ids:
            content = self._added.get(last_output_ids[-1])
            if content and glue.startswith(content):
                glue = glue[len(content):]
        return glue

    def extend(self, previous_prompt: list[int], previous_output: list[int],
               before_assistant: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> list[int]:
        """The next prompt: previous prompt + output + the new messages' tokens (an exact extension by construction)."""
        tail = self.encode(self.continuation_text(before_assistant, new_messages, previous_output))
        if not tail:
            raise HistoryRewriteError("the new messages render to no tokens; nothing to continue from")
        return [*previous_prompt, *previous_output, *tail]
