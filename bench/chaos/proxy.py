"""The network between trainer and buffer, misbehaving on command: a proxy that drops requests (the
connection closes before anything is forwarded), cuts answers mid-body (forwarded, then half the body and
a closed connection, as a network failure mid-response), and delays requests.

The scheduler arms a fault (`arm(kind)`); the next request takes it. Reads with data are the ones worth
cutting (a leased batch whose answer never arrives), so a cut waits for a `/get_rollout_data` answer that
carries data. Every fault that landed is counted in `applied`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

DROP, CUT, DELAY = "proxy_drop", "proxy_cut", "proxy_delay"


@dataclass
class ChaosProxy:
    upstream: str
    delay_s: float = 1.5
    applied: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    _armed: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _session: aiohttp.ClientSession | None = None

    def arm(self, kind: str) -> None:
        with self._lock:
            self._armed[kind] += 1

    def _take(self, kind: str) -> bool:
        with self._lock:
            if self._armed[kind] <= 0:
                return False
            self._armed[kind] -= 1
            self.applied[kind] += 1
            return True

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self.forward)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        body = await request.read()
        if self._take(DROP):
            return self._hang_up(request)  # the request never reaches the buffer
        if self._take(DELAY):
            await asyncio.sleep(self.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept", "authorization")}
        try:
            async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                             headers=headers) as up:
                payload = await up.read()
                status, content_type = up.status, up.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return self._hang_up(request)  # the buffer is down (killed, restarting): so is the connection
        carries_data = (request.path == "/get_rollout_data" and status == 200
                        and (b'"success":true' in payload or "packed" in content_type))
        if not (carries_data and self._take(CUT)):
            return web.Response(body=payload, status=status, content_type=content_type.split(";")[0])
        response = web.StreamResponse(status=status, headers={"Content-Type": content_type,
                                                               "Content-Length": str(len(payload))})
        try:
            await response.prepare(request)
            await response.write(payload[:len(payload) // 2])
        except ConnectionError:
            pass  # the client hung up first (its own timeout): cut all the same
        if request.transport is not None:
            request.transport.close()  # the rest of the body never arrives
        return response


    @staticmethod
    def _hang_up(request: web.Request) -> web.StreamResponse:
        """Close the client's connection without an answer, as a network failure would."""
        if request.transport is not None:  # None: the client hung up first
            request.transport.close()
        return web.Response(status=502)  # never reaches the client: its connection is closed


class ProxyServer:
    """The proxy on its own event loop in a thread, on a loopback port."""

    def __init__(self, proxy: ChaosProxy) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> "ProxyServer":
        self.thread.start()

        async def setup() -> str:
            self.runner = web.AppRunner(self.proxy.app(), shutdown_timeout=0.5)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

        self.url = asyncio.run_coroutine_threadsafe(setup(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
