"""The buffer's bearer token on the trainer side: where it comes from, and the headers that carry it.

A buffer started with a token (`rollout-buffer serve --auth-token-file ...`, or `ROLLOUT_BUFFER_AUTH_TOKEN`)
answers 401 to every request but `/health` that lacks `Authorization: Bearer <token>`. The adapter finds its
token, first match wins:

1. `args.agent_rollout_buffer_token` (slime's parser does not know `--agent-rollout-buffer-token`; set the
   attribute on the namespace, or add the flag to a parser of your own);
2. the environment variable `ROLLOUT_BUFFER_AUTH_TOKEN` (the same one the buffer reads: export it once for
   both, as `scripts/run_agent.sh` does);
3. the first line of the file named by `ROLLOUT_BUFFER_AUTH_TOKEN_FILE`.

`AgentRolloutSettings.from_args` remembers the token for its buffer URL, so every call to that buffer
(start, reads, acks, run checks, evaluation runs) sends it; a URL nobody registered gets the environment's
token (or token file), if any.
"""

from __future__ import annotations

import threading
from typing import Any

from rollout_buffer.security.auth import ENV_TOKEN, ENV_TOKEN_FILE, token_from_environment

__all__ = ["ENV_TOKEN", "ENV_TOKEN_FILE", "BufferAuthError", "auth_headers", "remember_token", "token_from"]


_tokens: dict[str, str] = {}
_lock = threading.Lock()


class BufferAuthError(RuntimeError):
    """The buffer refused the request (401): the token is missing or wrong. Retrying cannot help."""


def token_from(args: Any) -> str | None:
    """The token by the precedence of the module docstring, or None; an empty or unreadable token file
    raises ValueError (a silent fallback to no token would only turn into 401s later)."""
    value = getattr(args, "agent_rollout_buffer_token", None)
    if value:
        return str(value).strip()
    return token_from_environment()


def remember_token(buffer_url: str, token: str | None) -> None:
    """Use `token` for every request to `buffer_url` (and the paths under it); None forgets it."""
    base = buffer_url.rstrip("/")
    with _lock:
        if token:
            _tokens[base] = token
        else:
            _tokens.pop(base, None)


def auth_headers(url: str) -> dict[str, str]:
    """`{"Authorization": "Bearer ..."}` for a request to `url`, or `{}` when no token applies."""
    with _lock:
        matches = [base for base in _tokens if url == base or url.startswith(base + "/")]
        token = _tokens[max(matches, key=len)] if matches else None
    if token is None:
        token = token_from(None)
    return {"Authorization": f"Bearer {token}"} if token else {}
