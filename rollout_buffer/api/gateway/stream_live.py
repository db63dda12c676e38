"""A streamed answer sent as the engine generates it: the API's opening events once the turn has started,
then the deltas of the engine's text (`stream_text`) in the API's shape (`stream_openai`,
`stream_anthropic`, `stream_responses`), then the finishing events of the stored turn. A stream quiet for
`KEEPALIVE_S` gets a keep-alive comment, and once the turn has started (while the engine generates what
cannot be sent yet: a tool call's markup, sent once it closes) the API's keep-alive event as well
(Anthropic's `ping`, Responses' `response.in_progress`): some clients' idle timers count events, not the
SSE comments that keep a socket's reads alive.

A client that goes away while its turn generates cancels it: its engine call is aborted at the engine
(`/abort_request` with its rid), nothing is stored, and the run counts `gateway_streams_aborted`; a
retry of the same request is a new generation. A turn whose generation had finished is stored all the
same (a retry replays it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, Protocol

from rollout_buffer.api.gateway.errors import GatewayError, Opened
from rollout_buffer.api.gateway.sse_stream import COMMENT
from rollout_buffer.api.gateway.stream_text import Delta, TextStream
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.watch import Start, TurnWatch

log = logging.getLogger(__name__)
Event = tuple[str | None, Any]
_counting: set[asyncio.Task[None]] = set()
KEEPALIVE_S = 5.0  # a stream with no event for this long gets a keep-alive comment (and the API's event)


class LiveRenderer(Protocol):
    def start(self) -> list[Event]: ...

    def deltas(self, deltas: list[Delta]) -> list[Event]: ...

    def keepalive(self) -> list[Event]: ...

    def finish(self, answer: TurnAnswer) -> list[Event]: ...


async def live_events(task: asyncio.Task[TurnAnswer], watch: TurnWatch, opened: Opened,
                      live: Callable[[Start], LiveRenderer], render: Callable[[TurnAnswer], Iterable[Event]],
                      failed: Callable[[GatewayError], Event], gone: asyncio.Future[None]
                      ) -> AsyncGenerator[list[Event], None]:
    """The stream's events, one list per flush (sent as one write); ends when the client has gone (`gone`
    done), and cancels the turn when it leaves first (see the module docstring). A flush follows each read
    of the engine's stream, which reads at most every `engine_stream.COALESCE_S` (50 ms) after its first
    chunk, so the text is parsed and a write made once per read, not per token."""
    renderer: LiveRenderer | None = None
    text: TextStream | None = None
    read_chunks = 0  # the engine's chunks the text was last read at
    loop = asyncio.get_running_loop()
    quiet_since = loop.time()
    wake = watch.changed  # set by each read of the engine's stream, by the turn's end and by the client leaving
    task.add_done_callback(lambda _: wake.set())
    gone.add_done_callback(lambda _: wake.set())
    try:
        while True:
            wake.clear()
            sent: list[Event] = []
            if renderer is None and watch.start is not None:
                renderer = live(watch.start)
                text = TextStream(opened.ctx.parser, f"call_{watch.start.index}", watch.start.call_array)
                sent += renderer.start()
            if renderer is not None and text is not None and watch.chunks != read_chunks:
                read_chunks = watch.chunks
                so_far = watch.text
                if so_far:
                    sent += renderer.deltas(text.advance(so_far))
            if sent or loop.time() - quiet_since >= KEEPALIVE_S:
                if not sent:  # a prefill, a queue, a tool call's markup being generated: nothing else yet
                    sent += [(COMMENT, "keep-alive"), *(renderer.keepalive() if renderer is not None else ())]
                quiet_since = loop.time()
            if sent:
                yield sent
            if task.done() or gone.done():
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, quiet_since + KEEPALIVE_S - loop.time())):
                    await wake.wait()
        if gone.done():
            return
        try:
            answer = task.result()
        except GatewayError as exc:
            yield [failed(exc)]
            return
        if renderer is None or text is None:  # answered without generating (a replay)
            yield list(render(answer))
            return
        yield [*renderer.deltas(text.finish(answer.parsed)), *renderer.finish(answer)]
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
