"""A lean HTTP/1.1 server for the test engine's few JSON routes, and the JSON helpers its handlers share.

The engine shares the machine with the code under test and answers thousands of requests per second in
benchmarks; aiohttp's web application spent more CPU per request than the engine's own work. This serves
the same routes with httptools (llhttp): keep-alive and pipelined requests answered in order,
Content-Length and chunked request bodies, `Expect: 100-continue`, 404/405/413/400 answers, and a handler
is cancelled when its client disconnects (as aiohttp's `handler_cancellation`). Handlers return
`aiohttp.web.Response` objects, which are only read here.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

_MAX_BODY = 64 * 1024 * 1024


class BadRequest(Exception):
    """A client error answered with HTTP 400, as SGLang does for invalid input."""


class Request:
    """The part of aiohttp's `web.Request` the engine's handlers use."""

    __slots__ = ("_body", "headers", "method", "path")

    def __init__(self, method: str, path: str, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self._body = body

    async def read(self) -> bytes:
        return self._body


class Streamed:
    """A chunked answer (server-sent events): its chunks are written as they come; a client that disconnects
    cancels the handler's task, and with it the iterator."""

    def __init__(self, chunks: AsyncIterator[bytes], content_type: str = "text/event-stream") -> None:
        self.chunks = chunks
        self.content_type = content_type


Handler = Callable[[Request], Awaitable["web.Response | Streamed"]]


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object body ({} when empty); anything else is a BadRequest."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


class HTTPServer:
    """Routes (path -> method -> handler) served on one listening socket; `headers` go on every answer."""

    def __init__(self, routes: dict[str, dict[str, Handler]], headers: dict[str, str] | None = None) -> None:
        self.routes = routes
        self.extra_head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.connections: set[_HTTPConnection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HTTPConnection(self, loop), sock=sock, backlog=4096)

    async def dispatch(self, request: Request) -> web.Response | Streamed:
        by_method = self.routes.get(request.path)
        if by_method is None:
            return web.Response(status=404, text="404: Not Found")
        handler = by_method.get(request.method)
        if handler is None:
            return web.Response(status=405, text="405: Method Not Allowed",
                                headers={"Allow": ",".join(sorted(by_method))})
        return await handler(request)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, give running handlers `grace_s` to answer, then close every connection."""
        if self._server is not None:
            self._server.close()
        busy = [c.task for c in self.connections if c.task is not None]
        if busy:
            await asyncio.wait(busy, timeout=grace_s)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _HTTPConnection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, writes answers in order."""

    def __init__(self, server: HTTPServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[Request | None, bool]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._write(web.Response(status=400, text=f"400: Bad Request ({exc})"), keep_alive=False)

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            if name.lower() == "expect" and value.strip().lower() == "100-continue" and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= _MAX_BODY:
            self._body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = bool(self.parser.should_keep_alive())
        if self._size > _MAX_BODY:
            self.queue.append((None, False))
        else:
            path = httptools.parse_url(self._url).path or b"/"
            request = Request(self.parser.get_method().decode("ascii"), path.decode("utf-8", "replace"),
                              CIMultiDictProxy(CIMultiDict(self._headers)), b"".join(self._body))
            self.queue.append((request, keep_alive))
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                request, keep_alive = self.queue.popleft()
                if request is None:
                    response: web.Response | Streamed = web.Response(status=413, text="413: Request Entity Too Large")
                else:
                    try:
                        response = await self.server.dispatch(request)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a handler bug answers 500, as aiohttp does
                        response = web.Response(status=500, text=f"500: Internal Server Error ({exc!r})")
                if isinstance(response, Streamed):
                    await self._write_stream(response, keep_alive)
                else:
                    self._write(response, keep_alive)
                if not keep_alive:
                    return
        finally:
            self.task = None

    def _write(self, response: web.Response, keep_alive: bool) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        body = response.body if isinstance(response.body, bytes) else b""
        head = [f"HTTP/1.1 {response.status} {response.reason}\r\nContent-Length: {len(body)}\r\n"]
        for name, value in response.headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                head.append(f"{name}: {value}\r\n")
        head.append(self.server.extra_head)
        if not keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        self.transport.write("".join(head).encode("latin-1") + body)
        if not keep_alive:
            self.close()

    async def _write_stream(self, response: Streamed, keep_alive: bool) -> None:
        """The head, then each chunk as it comes (`Transfer-Encoding: chunked`), then the last chunk."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: {response.content_type}\r\nCache-Control: no-cache\r\n"
                f"Transfer-Encoding: chunked\r\n{self.server.extra_head}"
                f"{'' if keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n")
        self.transport.write(head.encode("latin-1"))
        async for chunk in response.chunks:
            if self.closed or self.transport.is_closing():
                return
            if chunk:
                self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.transport.write(b"0\r\n\r\n")
        if not keep_alive:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
