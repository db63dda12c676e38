"""The model relay: one rollout's model endpoints on a unix socket, and nothing else of the server.

An isolated sandbox (bwrap, docker) has no network. Its agent reaches the model through a unix socket
mounted into it (and `forwarder.py` on the sandbox's own loopback); this relay, on the worker's side of
that socket, lets through only requests that a model client makes (`/v1/...` paths, the methods below),
each with this session's key put in place of whatever the agent sent, so the socket opens exactly one
session's model endpoints: no admin route, no finish, no other session, whatever the agent tries.
Responses, streamed ones included, are copied back as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

ALLOWED_METHODS = {"GET", "POST", "HEAD"}
MODEL_PREFIX = "/v1/"
MAX_BODY_BYTES = 64 << 20
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
                "content-length", "authorization", "x-api-key", "proxy-authorization"}


class ModelRelay:
    """Serves `socket_path` until `close()`; forwards allowed requests to `upstream` with `api_key`."""

    def __init__(self, upstream: str, api_key: str, *, socket_dir: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.api_key = api_key
        self.folder = Path(tempfile.mkdtemp(prefix="rb-model-", dir=socket_dir))
        self.socket_path = str(self.folder / "model.sock")
        self.refused = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> "ModelRelay":
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                                              auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.UnixSite(self._runner, self.socket_path)
        await site.start()
        # the folder is the sandbox's view: anyone inside may connect (the agent runs as another uid)
        os.chmod(self.folder, 0o755)
        os.chmod(self.socket_path, 0o666)
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.rel_url.raw_path
        if request.method not in ALLOWED_METHODS or not path.startswith(MODEL_PREFIX) or ".." in path:
            self.refused += 1
            return web.json_response({"error": {"type": "forbidden", "message": f"{request.method} {path}: this "
                                      "sandbox reaches its session's model endpoints (/v1/...) only"}}, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["Authorization"] = f"Bearer {self.api_key}"
        headers["x-api-key"] = self.api_key
        body = await request.read() if request.can_read_body else None
        assert self._session is not None
        try:
            upstream = await self._session.request(request.method, f"{self.upstream}{request.rel_url}",
                                                   headers=headers, data=body, allow_redirects=False)
        except (aiohttp.ClientError, OSError) as exc:
            return web.json_response({"error": {"type": "unavailable", "message": f"the buffer is unreachable: "
                                                f"{type(exc).__name__}"}}, status=503, headers={"Retry-After": "1"})
        async with upstream:
            answer = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
            await answer.prepare(request)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
            with contextlib.suppress(ConnectionError):
                await answer.write_eof()
        return answer

    async def close(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._runner.cleanup(), 5)
        if self._session is not None:
            await self._session.close()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        with contextlib.suppress(OSError):
            self.folder.rmdir()
