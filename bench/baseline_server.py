"""`rollout-buffer serve` with the ingest benchmark's baselines mounted, run as
`python -m bench.baseline_server serve ARGS...` (the CLI's arguments): the product app, built and served
exactly as `serve` builds and serves it, plus two endpoints the product does not have:

* `POST /_bench/parse_only`: the same body parsing as `/buffer/write`, and nothing else (nothing stored);
* `POST /_bench/read_only`: the HTTP limit of this stack: read the body, parse nothing.

Both are answered the way the product answers `/buffer/write` (`rollout_buffer.api.fast_write`): by an ASGI
middleware in the same place (the innermost one), without the framework's routing. A baseline must carry
neither less nor more per-request cost than the write it is compared with.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer import cli
from rollout_buffer.api import app as app_module
from rollout_buffer.api.responses import OrjsonResponse
from rollout_buffer.settings import Settings
from rollout_buffer.wire.record_parsing import parse_record

_create_app = app_module.create_app
PATHS = ("/_bench/parse_only", "/_bench/read_only")


class Baselines:
    """ASGI middleware: the two baseline endpoints, everything else passed to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in PATHS:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if scope["path"] == PATHS[0]:
            answer = {"success": True, "message": "parsed", "data": {"uid": parse_record(body).record.uid}}
        else:
            answer = {"success": True, "message": "read", "data": {"bytes": len(body)}}
        await OrjsonResponse(answer)(scope, receive, send)


def create_app_with_baselines(settings: Settings) -> FastAPI:
    app = _create_app(settings)
    app.user_middleware.append(Middleware(Baselines))  # last in the list: innermost, where the write path sits
    return app


def main(argv: list[str] | None = None) -> int:
    # `cli.serve` looks the factory up when it runs: the one app it builds gets the baselines too
    app_module.create_app = create_app_with_baselines
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
