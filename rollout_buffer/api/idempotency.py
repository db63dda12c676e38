"""`Idempotency-Key` for creates: a client that did not get the answer to a create (a lost connection, or a
503 from a replica wait after the create was stored) retries with the same key and gets what the first
request created, never a second one. Without the key, every create is new, as before.

An entry is `rb:idem:<sha256 of scope, key>` (a string, one key per command: any cluster slot), holding the
request's digest and the answer's facts; it expires after `TTL_S`. A retry whose body differs from the
first is refused (422): the key names one request.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

TTL_S = 24 * 3600
HEADER = "idempotency-key"
MAX_KEY_CHARS = 255


class KeyReused(ValueError):
    """The key was used before for a request with another body."""


def entry_key(scope: str, key: str) -> str:
    return "rb:idem:" + hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()


def key_of(headers: Any) -> str | None:
    """The request's Idempotency-Key (ValueError when it is empty or longer than `MAX_KEY_CHARS`)."""
    key = headers.get(HEADER)
    if key is None:
        return None
    if not key.strip() or len(key) > MAX_KEY_CHARS:
        raise ValueError(f"Idempotency-Key must be 1-{MAX_KEY_CHARS} characters")
    return key


def request_digest(body: bytes | dict[str, Any]) -> str:
    raw = body if isinstance(body, bytes) else orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


async def claim(redis: Any, scope: str, key: str, digest: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Store `facts` under the key unless an earlier request did; the facts that hold (ours or the first
    request's). KeyReused when the first request's body was another."""
    name = entry_key(scope, key)
    blob = orjson.dumps({"digest": digest, "facts": facts})
    if not await redis.set(name, blob, nx=True, ex=TTL_S):
        stored = await redis.get(name)
        if stored is not None:
            entry = orjson.loads(stored)
            if entry["digest"] != digest:
                raise KeyReused("this Idempotency-Key was used for a request with another body")
            return dict(entry["facts"])
        await redis.set(name, blob, ex=TTL_S)  # expired in between: ours holds
    return facts


async def remember(redis: Any, scope: str, key: str, digest: str, facts: dict[str, Any]) -> None:
    """Store the facts of a create that has happened (overwriting a claim)."""
    await redis.set(entry_key(scope, key), orjson.dumps({"digest": digest, "facts": facts}), ex=TTL_S)


async def recall(redis: Any, scope: str, key: str, digest: str) -> dict[str, Any] | None:
    """The facts stored under the key, or None; KeyReused when they belong to another body."""
    stored = await redis.get(entry_key(scope, key))
    if stored is None:
        return None
    entry = orjson.loads(stored)
    if entry["digest"] != digest:
        raise KeyReused("this Idempotency-Key was used for a request with another body")
    return dict(entry["facts"])
