"""Ways to run a `TestEngine` inside a test: on its own loop in a daemon thread (sync tests), or on the
test's own event loop (async tests). Both stop the engine, and release what it holds, on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

from rollout_buffer.testing.engine.server import TestEngine


@contextlib.contextmanager
def background_loop(name: str) -> Iterator[Callable[..., Any]]:
    """An event loop in a daemon thread, stopped and closed on exit.

    Yields `run(coro, timeout_s=60)`, which runs a coroutine on that loop and waits for its result."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout_s)

    try:
        yield run
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


@contextlib.contextmanager
def run_engine_in_thread(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Iterator[TestEngine]:
    """Run a TestEngine on its own event loop in a daemon thread (for sync tests)."""
    engine = TestEngine(**kwargs)
    with background_loop("test-engine") as run:
        try:
            run(engine.start(host, port))
            yield engine
        finally:
            with contextlib.suppress(Exception):
                run(engine.stop(), 30)


@contextlib.asynccontextmanager
async def running_engine(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> AsyncIterator[TestEngine]:
    """Async context manager: start a TestEngine on the current loop, stop it on exit."""
    engine = TestEngine(**kwargs)
    await engine.start(host, port)
    try:
        yield engine
    finally:
        await engine.stop()
