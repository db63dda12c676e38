"""What the three API routes share: open the session, run the turn, map failures to the API's errors,
and frame a stream as server-sent events (`sse_stream`).

A streamed request's stream starts with its first generated token, or after `GRACE_S` with none, and
carries a keep-alive comment whenever it was quiet for `KEEPALIVE_S` (an agent CLI waits on its stream with
an idle timeout; a long prefill or a queue must not look like a dead server), and once the turn has started,
the API's own keep-alive event as well (`stream_live`); the tokens go out as they arrive
(`stream_live`), and a failure after the stream started is an error event in the API's own stream shape.
Failures before it are sent as before (an error keeps its HTTP status: a 429's `Retry-After` is what
clients retry on), and so is an answer ready at once (a replay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request

from rollout_buffer.api.gateway.constraints import NONE, Constraint
from rollout_buffer.api.gateway.errors import GatewayError, Opened
from rollout_buffer.api.gateway.json_limits import arguments_problem
from rollout_buffer.api.gateway.rendering import text_chars
from rollout_buffer.api.gateway.sse_stream import EventStream, frame
from rollout_buffer.api.gateway.stream_live import LiveRenderer, live_events
from rollout_buffer.api.gateway.turns import SessionClosed, TurnAnswer, TurnRequestError, run_turn
from rollout_buffer.api.gateway.watch import Start, TurnWatch
from rollout_buffer.runtime.engine_http import EngineError, TransientEngineError
from rollout_buffer.tasks.contract import HistoryRewriteError

log = logging.getLogger(__name__)
GRACE_S = 0.5
Event = tuple[str | None, Any]
_running: set[asyncio.Task[TurnAnswer]] = set()  # streamed turns, held until they end
MAX_CHARS_PER_TOKEN = 16  # no tokenizer packs more text than this into one token, but for degenerate text


async def answer_turn(opened: Opened, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      params: dict[str, Any], constraint: Constraint = NONE, watch: TurnWatch | None = None
                      ) -> TurnAnswer:
    """One turn, its failures as GatewayError: 400 a request it cannot render, 429 (Retry-After) the engine
    full or unreachable after retries, 502 the engine refusing."""
    problem = arguments_problem(messages)  # before any JSON of the history is parsed again
    if problem is not None:
        raise GatewayError(400, f"{problem[0]}: {problem[1]}", problem[0])
    limit = opened.gateway.settings.max_prompt_tokens
    if text_chars(messages) > limit * MAX_CHARS_PER_TOKEN:  # before the render: far too long to fit
        raise GatewayError(400, f"the conversation is {text_chars(messages)} characters, more than the "
                                f"{limit * MAX_CHARS_PER_TOKEN} a prompt of --max-prompt-tokens {limit} can hold",
                           "messages")
    try:  # the session's caps are checked with the turn's first round trip (`run_turn`)
        return await run_turn(opened.gateway, opened.ctx, opened.session, messages, tools,
                              {**params, **constraint.params()}, call_array=constraint.calls, watch=watch)
    except SessionClosed as exc:
        raise GatewayError(404, str(exc)) from exc
    except TurnRequestError as exc:
        raise GatewayError(400, str(exc), exc.param) from exc
    except HistoryRewriteError as exc:
        raise GatewayError(400, f"cannot render this conversation token-exactly: {exc}", "messages") from exc
    except EngineError as exc:
        if isinstance(exc, TransientEngineError) or isinstance(exc.__cause__, TransientEngineError):
            # retries ran out on 5xx / 429 / timeouts / connection errors: full or down, try again later
            await opened.gateway.store.incr_stat(opened.session.run_id, "gateway_engine_busy")
            raise GatewayError(429, f"the engine is busy or unreachable; retry later ({exc})") from exc
        await opened.gateway.store.incr_stat(opened.session.run_id, "gateway_engine_errors")
        raise GatewayError(502, f"the engine refused the request: {exc}") from exc


async def count(opened: Opened, counters: dict[str, int]) -> None:
    """Add to the run's counters (what a request sent that the gateway left out), when there is any."""
    if counters:
        await opened.gateway.store.incr_stats(opened.session.run_id, counters)


def _finished(task: asyncio.Task[TurnAnswer]) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:  # read, so an unread failure is not logged twice
        log.debug("a streamed turn failed: %s", task.exception())


async def streamed(turn: Awaitable[TurnAnswer], render: Callable[[TurnAnswer], Iterable[Event]],
                   failed: Callable[[GatewayError], Event], request: Request, *, opened: Opened, watch: TurnWatch,
                   live: Callable[[Start], LiveRenderer]) -> EventStream:
    """A streamed answer (see the module docstring); `watch` is the one `turn` reports to, `live` the API's
    renderer of a started turn. GatewayError when the turn fails before the stream starts."""
    task = asyncio.ensure_future(turn)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()  # the first chunk, the turn's end or the grace: one wake-up

    def wake(_: object = None) -> None:
        if not ready.done():
            ready.set_result(None)

    watch.on_first = wake
    task.add_done_callback(wake)
    timer = loop.call_later(GRACE_S, wake)
    if watch.chunks:
        wake()
    try:
        await ready
    finally:
        timer.cancel()
        watch.on_first = None
        task.remove_done_callback(wake)
    if task.done():  # answered (or failed) before the stream started: as a finished answer
        return sse(render(task.result()), request)
    _running.add(task)
    task.add_done_callback(_finished)

    async def stream(gone: asyncio.Future[None]) -> AsyncGenerator[bytes, None]:
        events = live_events(task, watch, opened, live, render, failed, gone)
        try:
            async for batch in events:
                yield frame(batch)
        finally:
            await events.aclose()  # its cleanup (the turn cancelled) runs now, not when collected

    return EventStream(stream)


def sse(events: Iterable[Event], request: Request) -> EventStream:
    """A finished answer framed as server-sent events (`frame`), sent as one write."""
    async def stream(gone: asyncio.Future[None]) -> AsyncGenerator[bytes, None]:
        yield frame(events)

    return EventStream(stream)
