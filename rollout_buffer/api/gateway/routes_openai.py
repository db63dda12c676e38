"""OpenAI routes: `POST /v1/chat/completions` (plain and streamed) and `GET /v1/models`."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.bodies import json_body
from rollout_buffer.api.gateway import wire_openai
from rollout_buffer.api.gateway.errors import GatewayError, error_body, error_response, open_session
from rollout_buffer.api.gateway.schemas import ChatCompletionsBody
from rollout_buffer.api.gateway.serving import answer_turn, count, streamed
from rollout_buffer.api.gateway.stream_openai import ChatStream
from rollout_buffer.api.gateway.watch import TurnWatch
from rollout_buffer.api.gateway.wire_common import json_object
from rollout_buffer.api.gateway.wire_fields import CHAT_READ, ignored_fields
from rollout_buffer.api.gateway.wire_tools import ignored_counters
from rollout_buffer.api.responses import OrjsonResponse

# the vendors' own protocols (their SDKs are the clients), documented in this API's schema by the fields the
# gateway reads (`schemas`), so /docs shows them and the schema fuzzer covers them
router = APIRouter(tags=["gateway"])


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionsBody))
async def chat_completions(request: Request) -> Any:
    raw = await request.body()  # first: an oversize body is 413 whatever else is wrong
    try:
        opened = await open_session(request)
        fields = json_object(raw)
        chat = wire_openai.read_request(fields)
        await count(opened, {**ignored_fields(fields, CHAT_READ, "openai"), **ignored_counters(chat.ignored_tools)})
        model = chat.model or opened.ctx.model
        sid = opened.session.session_id
        watch = TurnWatch() if chat.stream else None
        turn = answer_turn(opened, chat.messages, chat.tools, chat.params, chat.constraint, watch)
        if watch is not None:
            return await streamed(turn, lambda answer: [
                *((None, c) for c in wire_openai.chunks(answer, sid, model, chat.include_usage)), (None, "[DONE]")],
                lambda exc: (None, error_body("openai", exc.status, exc.message, exc.param)), request,
                opened=opened, watch=watch, live=lambda start: ChatStream(start, sid, model, chat.include_usage))
        answer = await turn
    except GatewayError as exc:
        return error_response("openai", exc)
    return OrjsonResponse(wire_openai.completion(answer, sid, model))


@router.get("/v1/models")
async def models(request: Request) -> Any:
    """The policy this session's run serves, in the asking SDK's shape (Anthropic's SDKs send
    `anthropic-version`)."""
    anthropic = "anthropic-version" in request.headers
    try:
        opened = await open_session(request, require_open=False)
    except GatewayError as exc:
        return error_response("anthropic" if anthropic else "openai", exc)
    model, created = opened.ctx.model, int(opened.session.created_at)
    if anthropic:
        stamp = datetime.fromtimestamp(created, tz=timezone.utc).isoformat().replace("+00:00", "Z")
        return {"data": [{"type": "model", "id": model, "display_name": model, "created_at": stamp}],
                "has_more": False, "first_id": model, "last_id": model}
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "rollout-buffer"}]}
