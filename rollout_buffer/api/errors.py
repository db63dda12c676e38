"""Uniform 4xx answers: every refusal is JSON `{"success": false, "message": ..., "errors": [...]}`
naming the problem, and the body-size limit is enforced before a large body is read into memory."""

from __future__ import annotations

import errno
import logging
import re
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_buffer.api.body_limits import BodyLimits, Limit
from rollout_buffer.api.responses import OrjsonResponse
from rollout_buffer.store.redis_client import is_outage, outage_of
from rollout_buffer.wire.packing import PackingError
from rollout_buffer.wire.strict import UNKNOWN_FIELD

log = logging.getLogger(__name__)


def error_response(status_code: int, message: str, errors: list[dict[str, Any]] | None = None,
                   extra: dict[str, Any] | None = None) -> OrjsonResponse:
    body: dict[str, Any] = {"success": False, "message": message, **(extra or {})}
    if errors:
        body["errors"] = errors
    return OrjsonResponse(body, status_code=status_code)


def _describe(error: dict[str, Any]) -> dict[str, Any]:
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    if error.get("type") == UNKNOWN_FIELD:  # raised for the whole body; it names its field
        loc = [*loc, str((error.get("ctx") or {}).get("field", ""))]
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return {"field": ".".join(x for x in loc if x) or "body", "message": msg, "type": error.get("type")}


async def _validation_handler(request: Request, exc: RequestValidationError) -> OrjsonResponse:
    errors = [_describe(e) for e in exc.errors()]
    if any(e["type"] == "json_invalid" for e in errors):
        return error_response(400, "malformed JSON body: " + "; ".join(e["message"] for e in errors))
    unknown = [e for e in errors if e["type"] in (UNKNOWN_FIELD, "extra_forbidden")]
    if unknown:  # a misspelled field is the client's mistake to see, not a value to ignore
        text = "; ".join(e["message"] if e["type"] == UNKNOWN_FIELD else f"unknown field {e['field']!r}"
                         for e in unknown)
        return error_response(400, f"invalid request body: {text}", unknown)
    if any(e["field"] == "body" and e["type"] in ("model_attributes_type", "model_type") for e in errors):
        return error_response(400, "request body must be a JSON object (send Content-Type: application/json)")
    text = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:10])
    return error_response(422, f"invalid request body: {text}", errors)


async def _http_handler(request: Request, exc: StarletteHTTPException) -> OrjsonResponse:
    return error_response(exc.status_code, str(exc.detail))


RETRY_AFTER_S = 1


def retry_response(message: str) -> OrjsonResponse:
    """503 "retry" with `Retry-After`: what every Redis outage answers, on every route."""
    answer = error_response(503, message)
    answer.headers["Retry-After"] = str(RETRY_AFTER_S)
    return answer


async def _redis_down_handler(request: Request, exc: Exception) -> OrjsonResponse:
    """Redis unreachable (restarting, network, a cluster slot failing over, too few replicas): the request
    may or may not have taken effect, so the client retries it; writes (by uid), leased reads (by batch_id),
    acks, turns (by request) and finishes are idempotent."""
    log.warning("%s %s: redis unavailable: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return retry_response(f"redis unavailable; retry the request (writes, leased reads and acks are "
                          f"idempotent): {type(exc).__name__}: {exc}")


async def _client_bug_handler(request: Request, exc: Exception) -> OrjsonResponse:
    """redis-py's own failures during a failover (`redis_client.is_outage`) are outages: 503 "retry". Any
    other error of these types is ours, and stays a 500."""
    if not is_outage(exc):
        raise exc
    return await _redis_down_handler(request, outage_of(exc))


# Redis refusing writes for a while: a failed background save (a full disk: `MISCONF`), out of memory, a
# replica that is not (yet) the primary, a cluster mid-resharding. Nothing was stored; a retry is safe.
RETRYABLE_REFUSAL = re.compile(r"(?:^|[\s-])(MISCONF|OOM|READONLY|NOREPLICAS|MASTERDOWN|LOADING|TRYAGAIN|CLUSTERDOWN) ")


async def _redis_refused_handler(request: Request, exc: ResponseError) -> OrjsonResponse:
    """A Redis error answer. The ones that pass with time are 503 "retry" (writes are idempotent by uid),
    the rest 500 with the reason; neither sends a traceback."""
    text = str(exc)
    if RETRYABLE_REFUSAL.search(text):  # also inside a script's error ("... @user_script: 157: -MISCONF ...")
        log.warning("%s %s: redis refused: %s", request.method, request.url.path, text[:300])
        answer = error_response(503, f"redis refused the request for now; retry it (writes, leased reads and acks "
                                     f"are idempotent): {text[:300]}")
        answer.headers["Retry-After"] = "5"
        return answer
    log.error("%s %s: redis error: %s", request.method, request.url.path, text[:300])
    return error_response(500, f"redis error: {text[:300]}")


async def _disk_full_handler(request: Request, exc: OSError) -> OrjsonResponse:
    """A full disk (or quota) where the server writes files itself: 503 retry; other OS errors are 500."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        log.warning("%s %s: disk full: %s", request.method, request.url.path, exc)
        answer = error_response(503, f"the server's disk is full; retry the request later: {exc.strerror}")
        answer.headers["Retry-After"] = "30"
        return answer
    log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(500, f"server error: {type(exc).__name__}: {exc.strerror or exc}")


async def _unstorable_handler(request: Request, exc: Exception) -> OrjsonResponse:
    """A value JSON allows but the store's packed form does not (integers beyond 64 bits, token ids beyond
    int32). Records are packed before any Redis call, so nothing was stored."""
    return error_response(422, f"the request holds a value that cannot be stored: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(orjson.JSONEncodeError, _unstorable_handler)
    app.add_exception_handler(PackingError, _unstorable_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    for error in (RedisConnectionError, RedisTimeoutError, BusyLoadingError):
        app.add_exception_handler(error, _redis_down_handler)
    for error in (AttributeError, RuntimeError):
        app.add_exception_handler(error, _client_bug_handler)
    app.add_exception_handler(ResponseError, _redis_refused_handler)  # type: ignore[arg-type]
    app.add_exception_handler(OSError, _disk_full_handler)  # type: ignore[arg-type]


class BodySizeLimit:
    """Refuses request bodies over their route family's limit (`rollout_buffer.api.body_limits`) with 413, by
    header or by counting streamed bytes."""

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.for_path(scope.get("path", ""))
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                if int(value) > limit.max_bytes:
                    await self._refuse(send, limit)
                    return
                if b"transfer-encoding" not in (n for n, _ in scope["headers"]):
                    # the HTTP parser delivers exactly content-length bytes: nothing to count
                    await self.app(scope, receive, send)
                    return
        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.max_bytes:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not response_started:
                await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: Limit) -> None:
        body = orjson.dumps({"success": False, "message": limit.message()})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(StarletteHTTPException):
    """Raised from `receive` when the streamed body passes the limit. An HTTPException, so FastAPI's own
    body parsing (which turns other errors into 400) lets it through and the answer is 413 on every route."""

    def __init__(self, limit: Limit) -> None:
        super().__init__(413, limit.message())
