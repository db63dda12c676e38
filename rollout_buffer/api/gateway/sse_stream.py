"""The HTTP response of a streamed answer: server-sent events written as the answer's stream yields them,
each yielded piece one write, and the client's disconnect handed to the stream (`Body` gets a future
that is done once the client has gone), which ends it: the stream's own `finally` then cancels the turn.

sse-starlette's response does this with four tasks per response (the stream, a ping, a disconnect
listener, a server-exit listener) and a lock and a cancel scope per write; at 64 concurrent streams that
bookkeeping was the largest part of what a streamed turn cost over a plain one. Here one task listens for
the disconnect, and the stream sends its own keep-alive comments (`stream_live`). Server-sent events'
framing is `frame`: one `data:` line per line of a string, JSON on one line.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Event = tuple[str | None, Any]
Body = Callable[["asyncio.Future[None]"], AsyncGenerator[bytes, None]]
COMMENT = ":"  # an Event named this is a comment line: `: <data>` (a keep-alive readers skip)
_LINES = re.compile(r"\r\n|\r|\n")  # a string's lines, each sent as one `data:` line (as the SSE spec reads them)


def frame(events: Iterable[Event]) -> bytes:
    """Server-sent events `(event name or None, data)` as one piece of the body; data that is not a string
    is sent as JSON, on one line (orjson escapes every newline)."""
    out = bytearray()
    for event, data in events:
        if event == COMMENT:
            out += b": %s\n\n" % str(data).encode()
            continue
        if event is not None:
            out += b"event: %s\n" % event.encode()
        if isinstance(data, str):
            for line in _LINES.split(data):
                out += b"data: %s\n" % line.encode()
        else:
            out += b"data: %s\n" % orjson.dumps(data)
        out += b"\n"
    return bytes(out)


class EventStream(Response):
    """`text/event-stream` with the headers SSE clients and proxies expect (no caching, no buffering)."""

    media_type = "text/event-stream"

    def __init__(self, body: Body) -> None:  # as Starlette's StreamingResponse: no body, no Content-Length
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"})
        self.stream = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        gone: asyncio.Future[None] = asyncio.ensure_future(_disconnect(receive))
        pieces = self.stream(gone)
        try:
            async for piece in pieces:
                if gone.done():
                    break
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if not gone.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await pieces.aclose()  # a stream left early runs its cleanup (a turn cancelled) now
            if gone.done() and not gone.cancelled():
                gone.exception()  # a receive that failed ended the stream like a disconnect: nothing to log
            gone.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
