"""The gateway's model routes (`/v1/chat/completions`, `/v1/messages`, `/v1/responses`) called without the
framework's routing.

A gateway turn is the API's commonest request under a thousand agents, and FastAPI's part of it (matching
the path against every route, the endpoint's request wrapper) was ~18% of the API's CPU per turn
(bench/README.md, "Gateway turn: where the CPU goes"). The endpoints take the bare `Request` and return a
`Response`, so this middleware, innermost like `FastWrite`, calls them itself and hands every other request
on unchanged. Errors the endpoints do not answer themselves go to the app's exception handlers, as for a
routed request; the routes stay mounted for `/docs`, the schema and as the reference.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.api.fast_write import handled
from rollout_buffer.api.gateway import routes_anthropic, routes_openai, routes_responses

Endpoint = Callable[[Request], Awaitable[Any]]
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": routes_openai.chat_completions,
                                  "/v1/messages": routes_anthropic.messages,
                                  "/v1/responses": routes_responses.responses}


class FastGateway:
    """ASGI middleware: POSTs to the model routes answered by their endpoints directly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            and not scope.get("root_path") else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response: Response | None = await endpoint(request)
        except Exception as exc:
            response = await handled(request, exc)
            if response is None:
                raise  # the framework's server-error middleware answers 500, as for a routed request
        await response(scope, receive, send)
