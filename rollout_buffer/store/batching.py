"""Group commit for Redis calls made by many concurrent rollouts.

A worker runs hundreds of rollouts at once, and each one claims its task, writes its record and finishes its
task with one Redis script call. Sent one by one, every call pays the client's full per-command cost
(connection checkout, a timeout task, a socket write and read). A `Coalescer` sends every call made while
the previous batch was in flight as one pipeline: no added delay when the worker is idle, a few round trips
instead of hundreds when it is busy. Each caller still gets its own result or exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

T = TypeVar("T")
R = TypeVar("R")

# A reply that is an exception fails that one call; an exception raised by the batch fails all of its calls.
BatchRunner = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]


class Coalescer(Generic[T, R]):
    """Runs `run_batch(items)` for the items submitted while the previous batch was in flight."""

    def __init__(self, run_batch: BatchRunner[T, R], *, max_batch: int = 128) -> None:
        self.run_batch = run_batch
        self.max_batch = max(1, max_batch)
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0
        self.items = 0

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new event loop (tests): nothing of the old one survives
            self._loop, self._pending, self._flusher = loop, [], None
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[:self.max_batch]
            del self._pending[:self.max_batch]
            live = [(item, future) for item, future in batch if not future.done()]
            if not live:
                continue
            self.batches += 1
            self.items += len(live)
            try:
                replies = await self.run_batch([item for item, _ in live])
                if len(replies) != len(live):
                    raise RuntimeError(f"batch of {len(live)} calls got {len(replies)} replies")
            except BaseException as exc:  # every caller of the batch sees the failure
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, future), reply in zip(live, replies, strict=True):
                if future.done():
                    continue
                if isinstance(reply, BaseException):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)


ScriptCall = tuple[AsyncScript, list[Any], list[Any]]


async def run_scripts(client: Any, calls: list[ScriptCall]) -> list[Any]:
    """Many script calls in one pipeline (no transaction); a failing call's reply is its exception.

    EVALSHA is queued directly, without redis-py's per-pipeline SCRIPT EXISTS round trip; a script the
    server does not know (restarted, flushed) answers NOSCRIPT without running, so it is loaded and only
    those calls are sent again."""
    if len(calls) == 1:  # nothing to share: the plain call also loads the script if needed
        script, keys, args = calls[0]
        return [await script(keys=keys, args=args)]
    replies = await _evalsha_pipeline(client, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            script.sha = await client.script_load(script.script)
        for i, reply in zip(missing, await _evalsha_pipeline(client, [calls[i] for i in missing]), strict=True):
            replies[i] = reply
    return replies


async def _evalsha_pipeline(client: Any, calls: list[ScriptCall]) -> list[Any]:
    pipe: Pipeline
    async with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))
