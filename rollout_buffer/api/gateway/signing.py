"""Signatures of the reasoning the gateway hands out, so that a client's echo of it can be trusted.

Anthropic `thinking` blocks carry a `signature`, Responses `reasoning` items an `encrypted_content` (when
the request asks with `include: ["reasoning.encrypted_content"]`). Clients that replay reasoning (Claude
Code, Codex, pydantic-ai) send these back unchanged, and some keep only signed thinking. Here a signature is
an HMAC of the reasoning text under one secret per server, kept in Redis (created once with SET NX, so every
API process signs and checks alike); `encrypted_content` carries the text itself and its HMAC (nothing is
secret about the text: the client was shown it). A block that comes back with a signature that does not
match its text was changed by the client: the message is marked (`history.UNVERIFIED`), so the history no
longer matches the session's own and the request is a counted fork (`edited`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import weakref
from typing import Any

from rollout_buffer.store import keys
from rollout_buffer.store.store import Store

_THINKING = b"thinking\x00"
_SEALED = "rbr1"
_cache: weakref.WeakKeyDictionary[Store, Signer] = weakref.WeakKeyDictionary()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Signs and checks reasoning text under the server's secret."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, text: str) -> str:
        return _b64(hmac.new(self._key, _THINKING + text.encode(), hashlib.sha256).digest()[:24])

    def sign(self, text: str) -> str:
        """An Anthropic thinking block's `signature`."""
        return self._mac(text)

    def verify(self, text: str, signature: Any) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self._mac(text), signature)

    def seal(self, text: str) -> str:
        """A Responses reasoning item's `encrypted_content`: the text and its signature."""
        return f"{_SEALED}.{_b64(text.encode())}.{self._mac(text)}"

    def unseal(self, token: Any) -> str | None:
        """The text of a sealed reasoning item, or None when it is not one of this server's, or was changed."""
        if not isinstance(token, str):
            return None
        tag, _, rest = token.partition(".")
        body, _, signature = rest.partition(".")
        if tag != _SEALED:
            return None
        try:
            text = _unb64(body).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        return text if self.verify(text, signature) else None


async def signer(store: Store) -> Signer:
    """This server's signer: the secret read (or created, once for all processes) from Redis."""
    found = _cache.get(store)
    if found is None:
        await store.redis.set(keys.GATEWAY_SIGNING_KEY, secrets.token_hex(32), nx=True)
        raw = await store.redis.get(keys.GATEWAY_SIGNING_KEY)
        found = Signer(raw if isinstance(raw, bytes) else str(raw).encode())
        _cache[store] = found
    return found
