"""A streamed answer sent as the engine generates it: the API's opening events once the turn has started,
then the deltas of the engine's text (`stream_text`) in the API's shape (`stream_openai`,
`stream_anthropic`, `stream_responses`), then the finishing events of the stored turn. While the engine
generates what cannot be sent yet (a tool call's markup, sent once it closes), a stream quiet for
`KEEPALIVE_S` gets the API's keep-alive event (Anthropic's `ping`, Responses' `response.in_progress`): some
clients' idle timers count events, not the SSE comments that keep a socket's reads alive.

A client that goes away while its turn generates cancels it: its engine call is aborted at the engine
(`/abort_request` with its rid), nothing is stored, and the run counts `gateway_streams_aborted`; a
retry of the same request is a new generation. A turn whose generation had finished is stored all the
same (a retry replays it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from rollout_buffer.api.gateway.errors import GatewayError, Opened
from rollout_buffer.api.gateway.stream_text import Delta, TextStream
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.watch import Start, TurnWatch

log = logging.getLogger(__name__)
Event = tuple[str | None, Any]
_counting: set[asyncio.Task[None]] = set()
FLUSH_S = 0.05  # deltas closer together go out as one: a stream's events at most every 50 ms
KEEPALIVE_S = 5.0  # a stream with no event for this long gets the API's keep-alive event


class LiveRenderer(Protocol):
    def start(self) -> list[Event]: ...

    def deltas(self, deltas: list[Delta]) -> list[Event]: ...

    def keepalive(self) -> list[Event]: ...

    def finish(self, answer: TurnAnswer) -> list[Event]: ...


async def live_events(task: asyncio.Task[TurnAnswer], watch: TurnWatch, opened: Opened,
                      live: Callable[[Start], LiveRenderer], render: Callable[[TurnAnswer], Iterable[Event]],
                      failed: Callable[[GatewayError], Event]) -> AsyncIterator[Event]:
    """The stream's events; cancels the turn when the client leaves first (see the module docstring)."""
    renderer: LiveRenderer | None = None
    text: TextStream | None = None
    loop = asyncio.get_running_loop()
    quiet_since = loop.time()
    try:
        while True:
            watch.changed.clear()
            sent: list[Event] = []
            if renderer is None and watch.start is not None:
                renderer = live(watch.start)
                text = TextStream(opened.ctx.parser, f"call_{watch.start.index}", watch.start.call_array)
                sent += renderer.start()
            if renderer is not None and text is not None and watch.text:
                sent += renderer.deltas(text.advance(watch.text))
            if sent or loop.time() - quiet_since >= KEEPALIVE_S:
                if not sent and renderer is not None:  # a tool call's markup being generated: nothing else yet
                    sent += renderer.keepalive()
                quiet_since = loop.time()
            for event in sent:
                yield event
            if task.done():
                break
            if renderer is not None:
                await asyncio.wait({task}, timeout=FLUSH_S)
                if task.done() or watch.changed.is_set():
                    continue
            waiter = asyncio.ensure_future(watch.changed.wait())
            try:
                await asyncio.wait({task, waiter}, timeout=max(FLUSH_S, quiet_since + KEEPALIVE_S - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        try:
            answer = task.result()
        except GatewayError as exc:
            yield failed(exc)
            return
        if renderer is None or text is None:  # answered without generating (a replay)
            for event in render(answer):
                yield event
            return
        for event in [*renderer.deltas(text.finish(answer.parsed)), *renderer.finish(answer)]:
            yield event
    finally:
        if not task.done() and not watch.generated:
            task.cancel()
            _count_abort(opened)


def _count_abort(opened: Opened) -> None:
    async def count() -> None:
        with contextlib.suppress(Exception):  # a counter, best effort: the client is gone either way
            await opened.gateway.store.incr_stat(opened.session.run_id, "gateway_streams_aborted")

    task = asyncio.get_running_loop().create_task(count())
    _counting.add(task)
    task.add_done_callback(_counting.discard)
