"""Anthropic route: `POST /v1/messages` (plain and streamed)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.bodies import json_body
from rollout_buffer.api.gateway import wire_anthropic
from rollout_buffer.api.gateway.errors import GatewayError, error_body, error_response, open_session
from rollout_buffer.api.gateway.field_labels import ignored_field_stats
from rollout_buffer.api.gateway.schemas import MessagesBody
from rollout_buffer.api.gateway.serving import answer_turn, count, streamed
from rollout_buffer.api.gateway.stream_anthropic import MessagesStream
from rollout_buffer.api.gateway.watch import TurnWatch
from rollout_buffer.api.gateway.signing import signer
from rollout_buffer.api.gateway.wire_common import json_object
from rollout_buffer.api.gateway.wire_tools import ignored_counters
from rollout_buffer.api.responses import OrjsonResponse

# the vendors' own protocols (their SDKs are the clients), documented in this API's schema by the fields the
# gateway reads (`schemas`), so /docs shows them and the schema fuzzer covers them
router = APIRouter(tags=["gateway"])


@router.post("/v1/messages", openapi_extra=json_body(MessagesBody))
async def messages(request: Request) -> Any:
    raw = await request.body()  # first: an oversize body is 413 whatever else is wrong
    try:
        opened = await open_session(request)
        signs = await signer(opened.gateway.store)
        body = wire_anthropic.read_request(json_object(raw), signs)
        if body.ignored:
            await opened.gateway.store.incr_stats(opened.session.run_id, ignored_field_stats("anthropic", body.ignored))
        await count(opened, ignored_counters(body.ignored_tools))
        sid = opened.session.session_id
        watch = TurnWatch() if body.stream else None
        turn = answer_turn(opened, body.messages, body.tools, body.params, body.constraint, watch)
        if watch is not None:
            return await streamed(turn, lambda answer: wire_anthropic.events(answer, sid, body.model, signs),
                                  lambda exc: ("error", error_body("anthropic", exc.status, exc.message)), request,
                                  opened=opened, watch=watch,
                                  live=lambda start: MessagesStream(start, sid, body.model, signs))
        answer = await turn
    except GatewayError as exc:
        return error_response("anthropic", exc)
    return OrjsonResponse(wire_anthropic.message(answer, sid, body.model, signs))
