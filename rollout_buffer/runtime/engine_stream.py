"""SGLang's streamed `/generate` read into the same answer as an unstreamed call.

Chunks are cumulative (SGLang's default) or incremental (`--incremental-streaming-output`); which one a
chunk is follows from `meta_info.completion_tokens` (every token so far) against the chunk's `output_ids`,
so both server settings give one answer: the whole output's ids, logprobs and text, and the last chunk's
`meta_info`. `on_text` hears of every chunk as it arrives (the gateway's streamed answers), with a reader of
the text so far.

A cumulative chunk repeats the whole output so far (text, ids, logprobs), so parsing each would cost a
turn O(n^2): once the stream is known to be cumulative, a chunk is kept as it came and parsed only when
it is still the latest one and the text is read (a streamed answer reads it at most every flush) or the
stream ends. The stream is cut into lines here, not by aiohttp's `readline`, which refuses a line longer
than its buffer's high-water mark (512 KiB: a cumulative chunk of some 12,000 tokens with logprobs).

Reading every chunk the moment it arrives costs a wake-up of the reader per token (SGLang streams one chunk
per token by default, `--stream-interval 1`). After each read the socket is left unread for
`COALESCE_S` (the loop's timer resumes it), so the chunks that came meanwhile are read at once: the first
token is read as it arrives, the later ones at most `COALESCE_S` late. The gateway's stream flushes after
each read, so its deltas go out at that pace too (20 a second: smoother than a reader's eye needs, and
one write where SGLang sent five chunks at 100 tokens/s).

A caller that is cancelled mid-stream aborts the request at the engine (`abort`) before the connection
closes, so the engine stops generating for a client that has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from rollout_buffer.runtime.engine_http import EngineError, EngineTimeout, TransientEngineError, json_object_of

COALESCE_S = 0.05  # after a read, the socket rests this long, so the chunks meanwhile come in one read


class StreamedAnswer:
    """The answer so far, merged chunk by chunk (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ids: list[int] = []
        self.logprobs: list[Any] = []
        self._text = ""
        self.meta: dict[str, Any] = {}
        self.cumulative: bool | None = None  # unknown until a chunk follows one with tokens
        self._latest: bytes | None = None  # a cumulative chunk not parsed yet: it holds everything so far

    def feed(self, data: bytes) -> None:
        """One chunk's JSON as it came."""
        if self.cumulative:
            self._latest = data
        else:
            self.add(self._parse(data))

    def text_so_far(self) -> str:
        """The text so far (what `on_text` is given to read it with)."""
        self.settle()
        return self._text

    def settle(self) -> None:
        """Parse the latest cumulative chunk, if one is waiting."""
        if self._latest is not None:
            data, self._latest = self._latest, None
            self.add(self._parse(data))

    def _parse(self, data: bytes) -> dict[str, Any]:
        return json_object_of(self.url, data, "streamed")

    def add(self, chunk: dict[str, Any]) -> None:
        meta = chunk.get("meta_info")
        ids = chunk.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise TransientEngineError(f"malformed stream chunk: {str(chunk)[:200]}")
        total = meta.get("completion_tokens")
        cumulative = len(ids) == total if isinstance(total, int) else ids[:len(self.ids)] == self.ids
        if self.cumulative is None and self.ids:  # a chunk after one with tokens tells the two apart
            self.cumulative = cumulative
        text = chunk.get("text")
        if not isinstance(text, str):
            text = ""
        if cumulative:  # the chunk's own lists, not copies: checked once, at the end (`parse_generate_answer`)
            self.ids, self._text = ids, text
        else:
            self.ids.extend(ids)
            self._text += text
        entries = meta.get("output_token_logprobs")
        if isinstance(entries, list):  # every token so far (SGLang) or only the new ones
            if len(entries) == len(self.ids):
                self.logprobs = entries
            else:
                self.logprobs.extend(entries)
        self.meta = meta

    def answer(self) -> dict[str, Any]:
        """In the shape of an unstreamed `/generate` answer."""
        self.settle()
        meta = dict(self.meta)
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = self.logprobs
        return {"text": self._text, "output_ids": self.ids, "meta_info": meta}


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, headers: dict[str, str],
                      timeout_s: float, on_text: Callable[[Callable[[], str]], None],
                      abort: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """One streamed POST to `/generate`; failures classified as `post_once` classifies them."""
    payload = orjson.dumps({**body, "stream": True}, option=orjson.OPT_SERIALIZE_NUMPY)
    merged = StreamedAnswer(url)
    aborted = False
    try:
        async with session.post(url, data=payload, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                headers={"Content-Type": "application/json", **headers}) as response:
            if response.status >= 400:
                raw = await response.read()
                kind = TransientEngineError if response.status >= 500 or response.status == 429 else EngineError
                raise kind(f"{url} answered HTTP {response.status}: {raw[:300]!r}")
            try:
                done = await _read(response, merged, on_text)
            except asyncio.CancelledError:  # while the engine streams to us: it hears the abort first
                aborted = True
                await _quietly(abort)
                raise
    except asyncio.CancelledError:  # before the stream started (a long prefill, a queue)
        if not aborted:
            await _quietly(abort)
        raise
    except TimeoutError as exc:
        raise EngineTimeout(f"no answer from {url} within {timeout_s:g}s") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise TransientEngineError(f"{type(exc).__name__} talking to {url}: {exc}") from exc
    merged.settle()
    if not done and not merged.meta.get("finish_reason"):
        raise TransientEngineError(f"{url} ended its stream before the answer finished")
    return merged.answer()


async def _read(response: aiohttp.ClientResponse, merged: StreamedAnswer,
                on_text: Callable[[Callable[[], str]], None]) -> bool:
    """The stream's chunks into `merged`, `on_text` told of each; whether it ended with `[DONE]`."""
    pending = bytearray()  # a line not finished yet
    connection = response.connection
    transport = connection.transport if connection is not None else None
    async for piece in response.content.iter_any():
        pending += piece
        if b"\n" not in piece:
            continue
        end = pending.rfind(b"\n")
        lines = bytes(pending[:end]).split(b"\n")
        del pending[:end + 1]
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            merged.feed(data)
            on_text(merged.text_so_far)
        if transport is not None and COALESCE_S > 0 and transport.is_reading():
            transport.pause_reading()  # resumed by the loop's timer: no wake-up of this task for it
            asyncio.get_running_loop().call_later(COALESCE_S, _resume, transport)
    return False


def _resume(transport: asyncio.Transport) -> None:
    if not transport.is_closing() and not transport.is_reading():
        transport.resume_reading()


async def _quietly(abort: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(abort(), timeout=5.0)
