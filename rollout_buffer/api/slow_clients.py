"""Slow clients: the HTTP connection handling `serve` runs under uvicorn.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and answers 503 past `limit_concurrency`,
but only once a request's headers are complete: a client that opens connections and never finishes its
headers (slowloris) held every one of them for over a minute, unauthenticated (authentication runs after
the headers), until the process ran out of descriptors and `/health` failed. This protocol (uvicorn's
httptools one, extended) closes a connection whose request headers are not complete within
`header_timeout_s` of its first byte or of the connection, and holds at most `max_connections`: a new
connection past the cap closes the oldest connection still waiting for its headers, or, when every
connection is busy with a real request, is answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rollout_buffer.metrics.processes import API_REQUESTS

MAX_DEFAULT_CONNECTIONS = 4096
_BUSY_BODY = b'{"success": false, "message": "too many connections; retry in a moment"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


def default_max_connections() -> int:
    """Three quarters of this process's open-file limit (the rest: Redis, files, workers), at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, soft * 3 // 4))


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a connection cap (class attributes, set by
    `guarded_protocol`)."""

    header_timeout_s: float = 5.0
    max_connections: int = MAX_DEFAULT_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self.waiting_since: float | None = None  # awaiting a request's headers since (monotonic)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._evict_one():
            transport.write(BUSY)
            transport.close()
            return
        self._await_headers()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for its headers; False when none is waiting."""
        waiting = [c for c in self.connections if isinstance(c, GuardedHttpTools) and c is not self
                   and c.waiting_since is not None and not c.transport.is_closing()]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.waiting_since or 0.0).transport.close()
        return True

    def _await_headers(self) -> None:
        self.waiting_since = time.monotonic()
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_done(self) -> None:
        self.waiting_since = None
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.waiting_since is not None and not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.waiting_since is None:  # the next request of a kept-alive connection
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._headers_done()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        # counted when the request is in, before its answer: here rather than in a middleware (one call, no
        # extra ASGI layer per request)
        API_REQUESTS.inc()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.waiting_since = None  # idle now: uvicorn's keep-alive timeout closes it if nothing comes

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)


def guarded_protocol(header_timeout_s: float, max_connections: int | None) -> type[GuardedHttpTools]:
    """The protocol class for uvicorn's `http=`, with these limits."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpTools,), {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections or default_max_connections()})
