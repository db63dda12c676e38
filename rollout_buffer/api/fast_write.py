"""`POST /buffer/write` (and `/runs/{run_id}/buffer/write`) served as a lean ASGI route.

Single-record writes are most of the API's requests, and their framework cost was a fifth of the server's
CPU under 64 writers (bench/README.md): eight middleware layers, route matching over every route, the
endpoint's dependency solving, and `jsonable_encoder` over the answer. This middleware, the innermost one
(inside the bearer-token check and the body-size limit), answers those two URLs itself with the same code
the framework routes run (`routes.writes.write_one`), and hands every other request on unchanged. Errors
get the app's own exception handlers, so every answer (4xx naming the problem, 503 when Redis is down) is
byte for byte the routed one; the routes stay mounted for `/docs` and as the reference.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.api.responses import OrjsonResponse
from rollout_buffer.api.routes.writes import write_one
from rollout_buffer.wire.record_parsing import parse_record

_PATH = "/buffer/write"
_RUNS = "/runs/"


def pinned_run(path: str) -> str | None | bool:
    """`None` for `/buffer/write`, the run id for `/runs/{run_id}/buffer/write`, False for any other path
    (the same match as the routes': one non-empty path segment for the run id)."""
    if path == _PATH:
        return None
    if path.startswith(_RUNS) and path.endswith(_PATH):
        run_id = path[len(_RUNS):-len(_PATH)]
        if run_id and "/" not in run_id:
            return run_id
    return False


class FastWrite:
    """ASGI middleware: single-record writes answered here, everything else passed to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        pinned = pinned_run(scope["path"])
        if pinned is False:
            await self.app(scope, receive, send)
            return
        app = scope["app"]
        try:
            body = await _body(receive)
            if body is None:  # the client went away before sending its body: nothing to answer
                return
            try:
                parsed = parse_record(body)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors(include_url=False)) from None
            status, answer = await write_one(app.state.buffer, parsed, pinned)  # type: ignore[arg-type]
            response: Any = OrjsonResponse(answer, status_code=status)
        except Exception as exc:
            response = await handled(Request(scope, receive), exc)
            if response is None:
                raise  # the framework's server-error middleware answers 500, as for a routed request
        await response(scope, receive, send)


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def handled(request: Request, exc: Exception) -> Response | None:
    """The app's own answer to `exc`, from its handler looked up along the exception's MRO as Starlette does;
    None when it has none (the caller re-raises, so the server-error middleware answers 500). The lean
    routes (this one, `api.gateway.fast_path`) answer errors as the routed requests would."""
    handlers = request.app.exception_handlers
    handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
    if handler is None:
        return None
    response = handler(request, exc)
    return await response if inspect.isawaitable(response) else response
