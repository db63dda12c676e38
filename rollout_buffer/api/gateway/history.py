"""Canonical messages and the prefix digests that match a client's history to a session's turns.

Clients send the whole conversation back with every call, in their SDK's spelling: `content` None or "",
text as a list of parts, tool call ids of their own, reasoning dropped, `arguments` re-serialised. The
canonical form keeps what the chat template renders (role, text, tool calls as name + parsed arguments)
and drops the rest, so an echoed assistant message matches the one the session generated. Reasoning is
dropped too, unless it came back with a signature that does not match it (`UNVERIFIED`, see `signing`):
then the message is not the one generated, and the request forks.

`prefix_digests` chains a digest over the canonical messages: `digests[i]` names the history
`messages[:i]` (and the tools), so looking a prefix up is one dictionary (Redis hash) lookup.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from rollout_buffer.api.gateway.json_limits import loads_or_raw

DIGEST_BYTES = 16
UNVERIFIED = "reasoning_unverified"  # set on an assistant message whose echoed reasoning failed its signature


def _text(content: Any) -> Any:
    """Text content as one string; a list of text parts is joined; other parts are kept as they are."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(raw: Any) -> Any:
    return loads_or_raw(raw) if isinstance(raw, str) else raw


def canonical(message: dict[str, Any]) -> bytes:
    """The bytes two spellings of one message share (see the module docstring)."""
    role = message.get("role")
    content = _text(message.get("content"))
    if isinstance(content, str) and isinstance(role, str) and not message.get("tool_calls") \
            and not message.get(UNVERIFIED):
        return b"\x01" + role.encode() + b"\x00" + content.encode()  # the common case, without a JSON dump
    form: list[Any] = [role, content]
    calls = message.get("tool_calls") or []
    if calls:
        form.append([[(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
                     for c in calls if isinstance(c, dict)])
    if message.get(UNVERIFIED):  # the client's reasoning, as it sent it: two different edits differ
        form.append([UNVERIFIED, message.get("reasoning_content")])
    return b"\x02" + orjson.dumps(form, option=orjson.OPT_SORT_KEYS)


def tools_digest(tools: list[dict[str, Any]] | None) -> bytes:
    """The digest a history starts from: the tools it is rendered with."""
    return hashlib.blake2b(orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS),
                           digest_size=DIGEST_BYTES).digest()


def extend(digest: bytes, message: dict[str, Any]) -> bytes:
    """The digest of a history one message longer."""
    return hashlib.blake2b(digest + canonical(message), digest_size=DIGEST_BYTES).digest()


def prefix_digests(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[bytes]:
    """`[d0, d1, ..., dn]`: `d[i]` is the digest of the tools and `messages[:i]`."""
    digests = [tools_digest(tools)]
    blake = hashlib.blake2b
    for message in messages:
        digests.append(blake(digests[-1] + canonical(message), digest_size=DIGEST_BYTES).digest())
    return digests


def request_digest(history: bytes, params: dict[str, Any]) -> bytes:
    """The digest of one exact request: a history and its sampling parameters (a retry sends the same)."""
    return hashlib.blake2b(history + orjson.dumps(params, option=orjson.OPT_SORT_KEYS),
                           digest_size=DIGEST_BYTES).digest()
