"""What the three API routes share: open the session, run the turn, map failures to the API's errors,
and frame a stream as server-sent events (sse-starlette)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson
from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from rollout_buffer.api.gateway import session_caps
from rollout_buffer.api.gateway.errors import GatewayError, Opened
from rollout_buffer.api.gateway.json_limits import arguments_problem
from rollout_buffer.api.gateway.turns import SessionClosed, TurnAnswer, TurnRequestError, run_turn
from rollout_buffer.runtime.engine_http import EngineError, TransientEngineError
from rollout_buffer.tasks.contract import HistoryRewriteError

log = logging.getLogger(__name__)
MAX_CHARS_PER_TOKEN = 16  # no tokenizer packs more text than this into one token, but for degenerate text


def text_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' text and tool-call arguments (what the template renders)."""
    total = 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else 0
        for call in message.get("tool_calls") or ():
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            total += len(arguments) if isinstance(arguments, str) else 0
    return total


async def answer_turn(opened: Opened, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      params: dict[str, Any]) -> TurnAnswer:
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
    session_caps.check_session(await session_caps.usage(opened.gateway, opened.session), opened.gateway.settings)
    try:
        answer = await run_turn(opened.gateway, opened.ctx, opened.session, messages, tools, params)
        await session_caps.account(opened.gateway, opened.session, answer)
        return answer
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


def sse(events: Iterable[tuple[str | None, Any]], request: Request) -> EventSourceResponse:
    """A finished answer framed as server-sent events: `(event name or None, data)`; data that is not a
    string is sent as JSON."""
    async def stream() -> AsyncIterator[ServerSentEvent]:
        for event, data in events:
            text = data if isinstance(data, str) else orjson.dumps(data).decode()
            yield ServerSentEvent(data=text, event=event)

    return EventSourceResponse(stream(), sep="\n", ping=15)
