"""The test engine's tokenizer work: decode ids to text and encode text to ids, cheaply.

The engine serves a thousand requests at once on the same cores as the code under test, so per-request
tokenizer cost matters. Also home of the regular Qwen vocabulary as bytes, which both the fast decoder and
the scripted policy's non-canonical token splits are built from.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from rollout_buffer.runtime.prompt_tokens import piece_encoder
from rollout_buffer.testing.tokenizer import NUM_REGULAR_TOKENS, ranks_file, read_ranks


@functools.lru_cache(maxsize=1)
def regular_vocab() -> tuple[list[bytes], dict[bytes, int]]:
    """Bytes of every regular Qwen token, and the reverse map (ids equal BPE ranks)."""
    ranks = read_ranks(ranks_file())
    by_id = [b""] * len(ranks)
    for token, rank in ranks.items():
        by_id[rank] = token
    return by_id, ranks


class Codec:
    """Lean decode and encode for one tokenizer.

    Decoding joins each id's bytes and decodes them as UTF-8 with replacement, which is what a byte-level BPE
    decoder does (checked against the tokenizer at construction; other tokenizers use the backend's own
    decode). Encoding is `tokenizer.encode(text, add_special_tokens=False)` without the wrapper's overhead.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encoder = piece_encoder(tokenizer)
        self._tables: tuple[list[bytes], list[bytes]] | None = None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # the wrapper post-edits decoded text
            self._backend = None
        elif self._backend is not None and type(self._backend.decoder).__name__ == "ByteLevel":
            self._tables = self._byte_tables(self._backend)
            if self._tables is not None and not self._self_check(self._backend):
                self._tables = None

    def _byte_tables(self, backend: Any) -> tuple[list[bytes], list[bytes]] | None:
        """(bytes per id keeping special tokens, bytes per id dropping them); None if the vocabulary is not Qwen's."""
        by_id, _ = regular_vocab()
        added = backend.get_added_tokens_decoder()
        size = max([len(by_id), *(int(i) + 1 for i in added)])
        if size != self.vocab_size or any(int(i) < len(by_id) for i in added):
            return None
        keep = [*by_id, *([b""] * (size - len(by_id)))]
        skip = list(keep)
        for token_id, token in added.items():
            keep[int(token_id)] = str(token.content).encode()
            skip[int(token_id)] = b"" if token.special else str(token.content).encode()
        return keep, skip

    def _self_check(self, backend: Any) -> bool:
        """The byte tables decode 200 random id lists exactly as the backend does."""
        rng = random.Random(0)
        added = list(backend.get_added_tokens_decoder())
        for _ in range(200):
            ids = [rng.choice(added) if rng.random() < 0.1 else rng.randrange(NUM_REGULAR_TOKENS)
                   for _ in range(rng.randint(1, 24))]
            for skip in (False, True):
                if self.decode(ids, skip_special_tokens=skip) != backend.decode(ids, skip_special_tokens=skip):
                    return False
        return True

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if self._tables is None:
            if self._backend is not None:
                return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        table = self._tables[1 if skip_special_tokens else 0]
        return b"".join([table[i] for i in ids]).decode("utf-8", "replace")

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text) if text else []


@functools.lru_cache(maxsize=8)
def codec_for(tokenizer: Any) -> Codec:
    """One codec per tokenizer and process (building the byte tables takes a moment)."""
    return Codec(tokenizer)
