"""Ways to run a `TestEngine` inside a test: on its own loop in a daemon thread (sync tests), or on the
test's own event loop (async tests). Both stop the engine, and release what it holds, on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from rollout_buffer.testing.engine.server import TestEngine


@contextlib.contextmanager
def run_engine_in_thread(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Iterator[TestEngine]:
    """Run a TestEngine on its own event loop in a daemon thread (for sync tests)."""
    engine = TestEngine(**kwargs)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-engine", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(host, port), loop).result(timeout=60)
        yield engine
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


@contextlib.asynccontextmanager
async def running_engine(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> AsyncIterator[TestEngine]:
    """Async context manager: start a TestEngine on the current loop, stop it on exit."""
    engine = TestEngine(**kwargs)
    await engine.start(host, port)
    try:
        yield engine
    finally:
        await engine.stop()
