"""Tokenizers by path, loaded once per process (loading takes seconds; rollouts need it per call).

The cache keeps the `CACHE_SIZE` most recently used tokenizers: a long-lived server that sees many
tokenizer paths over its runs does not keep every one in memory (a run in progress holds its own
reference, so eviction never unloads a tokenizer that is in use). Names that are not local folders are
looked up in the Hugging Face cache only, unless the caller allows downloads (`--allow-hub-downloads`);
which names may be loaded at all is `rollout_buffer.access`'s decision, made before this is called.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections import OrderedDict
from typing import Any

CACHE_SIZE = 8

_cache: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()


def _cached(path: str) -> Any:
    tokenizer = _cache.get(path)
    if tokenizer is not None:
        _cache.move_to_end(path)
    return tokenizer


def load_tokenizer(path: str, *, allow_download: bool = False) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, cached; safe to call from several threads. A hub name is
    read from the local Hugging Face cache unless `allow_download`."""
    with _lock:
        cached = _cached(path)
        if cached is not None:
            return cached
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=not allow_download)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer at {path!r} has no chat template")
        _cache[path] = tokenizer
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        if gc.isenabled() and gc.get_freeze_count():  # a process that froze its start-up objects (tune_gc):
            gc.freeze()  # the tokenizer lives as long, keep the collector from re-scanning it
        return tokenizer


async def get_tokenizer(path: str, *, allow_download: bool = False) -> Any:
    """The cached tokenizer, loading it in a thread the first time so the event loop keeps serving."""
    with _lock:
        cached = _cached(path)
    if cached is not None:
        return cached
    return await asyncio.to_thread(load_tokenizer, path, allow_download=allow_download)


def cached_paths() -> list[str]:
    """The paths whose tokenizers are cached, least recently used first (for tests and diagnostics)."""
    with _lock:
        return list(_cache)
