"""Each API's own error shape, and the session lookup every model endpoint starts with.

OpenAI (Chat Completions, Responses, models): `{"error": {"message", "type", "param", "code"}}`.
Anthropic (Messages): `{"type": "error", "error": {"type", "message"}}`. 401 unknown key, 400 naming the
bad field, 404 finished session or unknown run, 429 with `Retry-After` when the engine is full, 502 when
the engine failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request

from rollout_buffer.security import session_keys as keys_auth
from rollout_buffer.api.gateway.context import Gateway, RunContext
from rollout_buffer.store.sessions import Session
from rollout_buffer.api.responses import OrjsonResponse

Flavor = Literal["openai", "anthropic"]
RETRY_AFTER_S = 1

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 502: "api_error", 503: "api_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 502: "api_error", 503: "overloaded_error"}


class GatewayError(Exception):
    """An answer in the API's error shape; `param` names the field at fault (400s)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(flavor: Flavor, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if flavor == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "api_error"), "param": param,
                      "code": None}}


def error_response(flavor: Flavor, error: GatewayError) -> OrjsonResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
    return OrjsonResponse(error_body(flavor, error.status, error.message, error.param), status_code=error.status,
                          headers=headers)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


@dataclass
class Opened:
    """A request's session, its run, and the gateway."""

    gateway: Gateway
    ctx: RunContext
    session: Session


async def open_session(request: Request, *, require_open: bool = True) -> Opened:
    """The session the request's API key opens; GatewayError 401 / 404 otherwise."""
    api_key = keys_auth.key_from_headers(request.headers.get("authorization"), request.headers.get("x-api-key"))
    parsed = keys_auth.parse_key(api_key) if api_key else None
    if parsed is None:
        raise GatewayError(401, "invalid API key: send the session's api_key (POST /runs/{run_id}/sessions) as "
                                "'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    session_id, secret = parsed
    gw = gateway_of(request)
    run_id = keys_auth.run_of(session_id) or ""
    # a session this process knows needs no read here: its status is checked with the turn's own lookups
    session = gw.sessions.known(session_id) if require_open else None
    fresh = session is None
    if session is None:
        session = await gw.sessions.get(run_id, session_id)
    if session is None or not keys_auth.key_matches(secret, session.key_digest):
        raise GatewayError(401, "invalid API key: no session has this key")
    if fresh and require_open and not session.is_open:
        raise GatewayError(404, f"session {session_id} is {session.status}: it takes no more requests")
    ctx = await gw.context(run_id)
    if ctx is None:
        raise GatewayError(404, f"run {run_id} is gone or is not an external run")
    return Opened(gw, ctx, session)
