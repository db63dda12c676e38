"""Tokenizers by path, loaded once per process (loading takes seconds; rollouts need it per call).

The cache keeps the `CACHE_SIZE` most recently used tokenizers: a long-lived server that sees many
tokenizer paths over its runs does not keep every one in memory (a run in progress holds its own
reference, so eviction never unloads a tokenizer that is in use). Names that are not local folders are
looked up in the Hugging Face cache only, unless the caller allows downloads (`--allow-hub-downloads`);
which names may be loaded at all is `rollout_buffer.security.access`'s decision, made before this is called.

A process that only checks that a run's tokenizer loads (the API, when worker processes do the rollouts)
uses `check_tokenizer_in_child`: a short-lived child process loads it, so the API never holds the ~100 MB
a Qwen tokenizer and transformers take.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

CACHE_SIZE = 8
CHECKED_SIZE = 256  # (path, folder version) pairs remembered as loadable

# The child of `check_tokenizer_in_child`: load, and on failure print the reason as its last stderr line.
_CHECK_SCRIPT = """
import sys
from rollout_buffer.logs import hide_torch_notice
hide_torch_notice()
from rollout_buffer.runtime.tokenizers import check_tokenizer
try:
    check_tokenizer(sys.argv[1], allow_download=sys.argv[2] == "1")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}".replace(chr(10), " "), file=sys.stderr)
    sys.exit(1)
"""
_cache: OrderedDict[str, Any] = OrderedDict()
_checked: OrderedDict[tuple[str, int], None] = OrderedDict()
_lock = threading.Lock()


def _cached(path: str) -> Any:
    tokenizer = _cache.get(path)
    if tokenizer is not None:
        _cache.move_to_end(path)
    return tokenizer


def _load(path: str, allow_download: bool) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=not allow_download)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer at {path!r} has no chat template")
    return tokenizer


def load_tokenizer(path: str, *, allow_download: bool = False) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, cached; safe to call from several threads. A hub name is
    read from the local Hugging Face cache unless `allow_download`."""
    with _lock:
        cached = _cached(path)
        if cached is not None:
            return cached
        tokenizer = _load(path, allow_download)
        _cache[path] = tokenizer
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        if gc.isenabled() and gc.get_freeze_count():  # a process that froze its start-up objects (tune_gc):
            gc.freeze()  # the tokenizer lives as long, keep the collector from re-scanning it
        release_free_heap()
        return tokenizer


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). Loading a tokenizer parses an
    18 MB tokenizer.json into temporary structures: measured, a Qwen tokenizer leaves a process at 290 MB
    RSS after loading, 125 MB after the trim. It matters with one worker process per core."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _version(path: str) -> int:
    """The tokenizer folder's modification time (0 for a hub id): a folder changed since is checked again."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def checked_key(path: str) -> str:
    """`path` and its folder version as one string: how other processes remember a passed check (the API
    keeps it in Redis, so a restarted API does not start a checking child again for an unchanged folder)."""
    return f"{_version(path)}|{path}"


def remember_checked(path: str) -> None:
    """Take a check another process made (of the folder as it is now) as passed."""
    _remember_checked((path, _version(path)))


def _remember_checked(key: tuple[str, int]) -> None:
    _checked[key] = None
    while len(_checked) > CHECKED_SIZE:
        _checked.popitem(last=False)


def check_tokenizer(path: str, *, allow_download: bool = False) -> None:
    """Raise if the tokenizer at `path` does not load or has no chat template; keeps nothing loaded. A path
    that passed (unchanged since) or is cached passes at once."""
    key = (path, _version(path))
    with _lock:
        if path in _cache or key in _checked:
            return
        tokenizer = _load(path, allow_download)
        del tokenizer
        _remember_checked(key)
    gc.collect()
    release_free_heap()


async def check_tokenizer_in_child(path: str, *, allow_download: bool = False, timeout_s: float = 300.0) -> None:
    """`check_tokenizer` in a child process (raises OSError or ValueError with the child's reason);
    remembered like it."""
    key = (path, _version(path))
    if path in _cache or key in _checked:
        return
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHECK_SCRIPT, path,
                                                "1" if allow_download else "0",
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ValueError(f"loading it took longer than {timeout_s:g}s") from None
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"the check exited with {proc.returncode}"
        # the child's OSError (a missing folder, a hub name not in the cache) stays an OSError here
        raise (OSError if reason.startswith("OSError") else ValueError)(reason)
    _remember_checked(key)


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
