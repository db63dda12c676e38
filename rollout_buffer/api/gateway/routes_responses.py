"""OpenAI Responses route: `POST /v1/responses` (plain and streamed). `previous_response_id` continues
from a stored turn of the same session (the history is the session's own, nothing is re-sent)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.bodies import json_body
from rollout_buffer.api.gateway import wire_responses
from rollout_buffer.api.gateway.errors import GatewayError, Opened, error_response, open_session
from rollout_buffer.store.session_turns import conversation
from rollout_buffer.api.gateway.schemas import ResponsesBody
from rollout_buffer.api.gateway.serving import answer_turn, count, streamed
from rollout_buffer.api.gateway.stream_responses import ResponsesStream
from rollout_buffer.api.gateway.watch import TurnWatch
from rollout_buffer.api.gateway.signing import signer
from rollout_buffer.api.gateway.wire_common import json_object
from rollout_buffer.api.gateway.wire_fields import RESPONSES_READ, ignored_fields
from rollout_buffer.api.gateway.wire_tools import ignored_counters
from rollout_buffer.api.responses import OrjsonResponse

# the vendors' own protocols (their SDKs are the clients), documented in this API's schema by the fields the
# gateway reads (`schemas`), so /docs shows them and the schema fuzzer covers them
router = APIRouter(tags=["gateway"])


async def _history(opened: Opened, body: wire_responses.ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation the request continues: the named previous response's (its instructions replaced
    by the request's), or the instructions."""
    if body.previous_response_id is None:
        return [{"role": "system", "content": body.instructions}] if body.instructions else []
    sid = opened.session.session_id
    index = wire_responses.turn_of(body.previous_response_id, sid)
    nodes = await opened.gateway.sessions.all_nodes(opened.session.run_id, sid)
    by_index = {n.index: n for n in nodes}
    if index is None or index not in by_index:
        raise GatewayError(400, f"previous_response_id {body.previous_response_id!r} is not a response of this "
                                "session", "previous_response_id")
    history = conversation(by_index, by_index[index])
    if body.instructions is None:
        return history  # kept from the chain (OpenAI would drop them: a client that sends none changes nothing)
    # a request's instructions replace the chain's (as OpenAI applies them): new ones change the prefix, a fork
    head = {"role": "system", "content": body.instructions}
    return [head, *history[1:]] if history and history[0].get("role") == "system" else [head, *history]


def _stream_error(exc: GatewayError) -> tuple[str, dict[str, Any]]:
    """A failure after the stream started: Responses' `error` event."""
    return "error", {"type": "error", "code": str(exc.status), "message": exc.message, "param": exc.param,
                     "sequence_number": 0}


@router.post("/v1/responses", openapi_extra=json_body(ResponsesBody))
async def responses(request: Request) -> Any:
    raw = await request.body()  # first: an oversize body is 413 whatever else is wrong
    try:
        opened = await open_session(request)
        fields = json_object(raw)
        body = wire_responses.read_request(fields, await signer(opened.gateway.store))
        await count(opened, {**ignored_fields(fields, RESPONSES_READ, "responses"),
                             **ignored_counters(body.toolset.ignored)})
        messages = [*await _history(opened, body), *body.items]
        sid = opened.session.session_id
        model = body.model or opened.ctx.model
        watch = TurnWatch() if body.stream else None
        turn = answer_turn(opened, messages, body.tools, body.params, body.constraint, watch)
        if watch is not None:
            return await streamed(turn, lambda answer: wire_responses.events(answer, sid, body, model),
                                  _stream_error, request, opened=opened, watch=watch,
                                  live=lambda start: ResponsesStream(start, sid, body, model))
        answer = await turn
    except GatewayError as exc:
        return error_response("openai", exc)
    return OrjsonResponse(wire_responses.response(answer, sid, body, model))
