"""Bearer-token authentication of every route but `/health`, and per-run write capabilities.

With a token set (`--auth-token`, `ROLLOUT_BUFFER_AUTH_TOKEN` or `--auth-token-file`), a request must carry
`Authorization: Bearer <token>`; the comparison is constant-time (`hmac.compare_digest`). Anything else
gets 401 before the route runs or the body is read. `/health` stays open so load balancers and start-up
scripts can probe the server without the secret.

slime-style task modules post their records with plain `requests`/`urllib` and no headers, to the URL they
are given. They get a capability URL instead of the token: `<buffer>/runs/<run_id>/cap/<key>`, where
`key` is an HMAC-SHA256 of the run id under the token. `POST <that URL>/buffer/write` is accepted, and
rewritten to `/runs/<run_id>/buffer/write`; the key opens nothing else, and no other run.

Browsers cannot add a header to a page they navigate to, so the dashboard is opened once as
`/?token=<token>`: a valid token in the `token` query parameter of a GET answers 303 to the same path
without it (always a path on this server: `same_origin_path`) and sets an HttpOnly, SameSite=Strict cookie
(an HMAC of the token, not the token), which the page's own requests then carry. The cookie is accepted for
GET and HEAD only: nothing that changes state can be done with it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, urlencode

import orjson

if TYPE_CHECKING:  # types only: the trainer side imports this module and installs no starlette
    from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})
# The agent gateway's model endpoints and session finish check a session's own API key (or the token) in
# the route (`rollout_buffer.api.gateway`); creating sessions needs the token like every other route.
GATEWAY_PREFIXES = ("/v1/", "/sessions/")
CAPABILITY_PATH = re.compile(r"^/runs/(?P<run_id>[^/]+)/cap/(?P<key>[0-9a-f]{64})/buffer/write$")
_BEARER = b"bearer "
COOKIE = "rollout_buffer_token"
ENV_TOKEN = "ROLLOUT_BUFFER_AUTH_TOKEN"
ENV_TOKEN_FILE = "ROLLOUT_BUFFER_AUTH_TOKEN_FILE"
SAFE_METHODS = frozenset({"GET", "HEAD"})
SESSION_KEY_PREFIX = b"sk-rb-"  # rollout_buffer.security.session_keys.KEY_PREFIX


def token_from_environment() -> str | None:
    """A client's token: `ROLLOUT_BUFFER_AUTH_TOKEN`, else the first line of the file named by
    `ROLLOUT_BUFFER_AUTH_TOKEN_FILE`, else None. An empty or unreadable token file raises ValueError (a
    silent fallback to no token would only turn into 401s later)."""
    value = os.environ.get(ENV_TOKEN, "").strip()
    if value:
        return value
    path = os.environ.get(ENV_TOKEN_FILE, "").strip()
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.readline().strip()
    except OSError as exc:
        raise ValueError(f"{ENV_TOKEN_FILE}={path!r}: {exc.strerror}") from exc
    if not token:
        raise ValueError(f"{ENV_TOKEN_FILE}={path!r} is empty")
    return token


def capability(token: str, run_id: str) -> str:
    """The write key of one run: HMAC-SHA256(token, run id), hex."""
    return hmac.new(token.encode(), f"run-write:{run_id}".encode(), hashlib.sha256).hexdigest()


def browser_key(token: str) -> str:
    """The dashboard cookie's value: HMAC-SHA256(token, "browser"), hex (safe in a cookie, and not the
    token itself)."""
    return hmac.new(token.encode(), b"browser", hashlib.sha256).hexdigest()


def run_write_url(buffer_url: str, run_id: str, token: str | None) -> str:
    """The base URL a slime-style module of `run_id` posts `/buffer/write` under: the run's own URL, with
    its write key in the path when the server requires a token."""
    base = f"{buffer_url.rstrip('/')}/runs/{run_id}"
    return f"{base}/cap/{capability(token, run_id)}" if token else base


def route_path(scope: Scope) -> str:
    """The path the router matches: the request path without the app's `root_path` (behind a proxy)."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def same_origin_path(path: str) -> str:
    """`path` as a redirect target that no browser can read as another site: percent-encoded (a `\\`, a
    tab or a newline, which browsers turn into `/` or drop, become inert `%5C`, `%09`, `%0A`) and with
    exactly one leading `/` (`//evil.example` is a URL of another host, `/evil.example` is not)."""
    return "/" + quote(path, safe="/").lstrip("/")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_matches(header: bytes | None, token: bytes) -> bool:
    """Constant-time check of an `Authorization` header value against the token."""
    if header is None or len(header) < len(_BEARER) or header[: len(_BEARER)].lower() != _BEARER:
        return False
    return hmac.compare_digest(header[len(_BEARER):].strip(), token)


def cookie_value(header: bytes | None, name: str = COOKIE) -> bytes | None:
    """The value of cookie `name` in a `Cookie` header, or None."""
    for part in (header or b"").split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name.encode():
            return value
    return None


class SessionKeyScope:
    """ASGI middleware: a request carrying a gateway session key (`sk-rb-...`) reaches the gateway's paths
    (`GATEWAY_PREFIXES`) and nothing else, with or without a server token: such a key is an agent's, and an
    agent opens its session's model endpoints only (the routes check which session; a rollout's key cannot
    even finish its own). 403 for anything else, before the route runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not route_path(scope).startswith(GATEWAY_PREFIXES) and _has_session_key(scope):
            body = orjson.dumps({"success": False, "message": "a session API key opens its session's model "
                                                              "endpoints (/v1/*) only"})
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _has_session_key(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"x-api-key" and value.strip().startswith(SESSION_KEY_PREFIX):
            return True
        if name == b"authorization" and value[:7].lower() == _BEARER and value[7:].strip().startswith(SESSION_KEY_PREFIX):
            return True
    return False


class BearerAuth:
    """ASGI middleware: 401 for every request without the token, except `OPEN_PATHS`, a valid capability
    write, and GET/HEAD requests with the dashboard cookie or `?token=` (see the module docstring)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self._token_bytes = token.encode()
        self._browser_key = browser_key(token).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path in OPEN_PATHS or path.startswith(GATEWAY_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        if bearer_matches(headers.get(b"authorization"), self._token_bytes):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") in SAFE_METHODS:
            cookie = cookie_value(headers.get(b"cookie"))
            if cookie is not None and hmac.compare_digest(cookie, self._browser_key):
                await self.app(scope, receive, send)
                return
            if await self._token_in_query(scope, send):
                return
        match = CAPABILITY_PATH.match(path)
        if (match and scope["type"] == "http" and scope.get("method") == "POST"
                and hmac.compare_digest(match["key"], capability(self.token, match["run_id"]))):
            prefix = scope["path"][: len(scope["path"]) - len(path)]
            rewritten = f"/runs/{match['run_id']}/buffer/write"
            await self.app({**scope, "path": prefix + rewritten, "raw_path": (prefix + rewritten).encode()},
                           receive, send)
            return
        await self._refuse(scope, send)

    async def _token_in_query(self, scope: Scope, send: Send) -> bool:
        """A GET with the valid token as `?token=`: 303 to the URL without it, setting the cookie."""
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = next((value for name, value in query if name == "token"), None)
        if given is None or not hmac.compare_digest(given.encode(), self._token_bytes):
            return False
        rest = urlencode([(name, value) for name, value in query if name != "token"])
        location = same_origin_path(scope.get("root_path", "") + route_path(scope)) + (f"?{rest}" if rest else "")
        cookie = f"{COOKIE}={browser_key(self.token)}; HttpOnly; SameSite=Strict; Path=/"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode()),
                                (b"cache-control", b"no-store"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return True

    async def _refuse(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = orjson.dumps({"success": False, "message": "authentication required: send 'Authorization: Bearer "
                                                          "<token>' with the server's --auth-token (in a browser, open /?token=<token> once)"})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
