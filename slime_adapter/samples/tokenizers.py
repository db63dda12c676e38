"""One tokenizer per path per process: loading a fast tokenizer costs ~1 s, building samples needs it often."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["get_tokenizer", "clear_tokenizer_cache"]


@functools.lru_cache(maxsize=16)
def _load(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def get_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer at `path` (a local directory or hub name), loaded on first use and then reused."""
    if not path:
        raise ValueError("tokenizer path is empty")
    return _load(str(path), trust_remote_code)


def clear_tokenizer_cache() -> None:
    """Forget loaded tokenizers (after a checkpoint's tokenizer files changed on disk)."""
    _load.cache_clear()
