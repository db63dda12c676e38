"""Session ids and session API keys.

A session id is `"{run_id}~{random}"` (`~` never occurs in a run id), so a request names its run without
a lookup. Its API key is `"sk-rb-{session_id}.{secret}"`: the session id and 32 random hex characters;
Redis keeps only a SHA-256 digest of the secret, and the check is constant-time. A key opens its own
session's model endpoints and (an external run's session) its finish, nothing else: a rollout's own session
(`scope="model"`) refuses its key at finish, and every non-gateway route refuses any session key
(`rollout_buffer.security.auth.SessionKeyScope`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-rb-"
_SEP = "~"


def new_session_id(run_id: str) -> str:
    return f"{run_id}{_SEP}{secrets.token_hex(8)}"


def run_of(session_id: str) -> str | None:
    """The run a session id belongs to, or None for text that is not a session id."""
    run_id, sep, rest = session_id.rpartition(_SEP)
    return run_id if sep and run_id and rest else None


def new_key(session_id: str) -> tuple[str, str]:
    """(API key, the digest stored with the session)."""
    secret = secrets.token_hex(16)
    return f"{KEY_PREFIX}{session_id}.{secret}", digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(api_key: str) -> tuple[str, str] | None:
    """(session id, secret) of an API key, or None when it is not one of ours."""
    if not api_key.startswith(KEY_PREFIX):
        return None
    session_id, sep, secret = api_key[len(KEY_PREFIX):].rpartition(".")
    if not sep or not secret or run_of(session_id) is None:
        return None
    return session_id, secret


def key_matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)


def key_from_headers(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a client sent: `x-api-key` (Anthropic SDKs) or `Authorization: Bearer` (OpenAI SDKs)."""
    if x_api_key:
        return x_api_key.strip()
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None
