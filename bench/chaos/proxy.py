"""The network between the trainer (and the agents) and the buffer, misbehaving on command: the fault proxy
of the tests (`tests.support.faults.FaultProxy`: drops requests, cuts answers mid-body, delays), run on its
own event loop in a thread so the scheduler can arm it from any thread.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from tests.support.faults import CUT, DELAY, DROP, FaultProxy

ChaosProxy = FaultProxy
__all__ = ["CUT", "DELAY", "DROP", "ChaosProxy", "ProxyServer"]


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
