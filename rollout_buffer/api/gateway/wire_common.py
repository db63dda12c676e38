"""Request checks the three wire APIs share: a JSON object body, typed fields, message normalisation."""

from __future__ import annotations

import math
from typing import Any

import orjson

from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.json_limits import MAX_BODY_DEPTH, value_depth


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    if value_depth(body) > MAX_BODY_DEPTH:  # the chat template's `tojson` recurses over what it renders
        raise GatewayError(400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels")
    return body


def opt_int(body: dict[str, Any], name: str, *, minimum: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GatewayError(400, f"{name} must be an integer >= {minimum}, got {value!r}", name)
    return value


def opt_number(body: dict[str, Any], name: str, low: float, high: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or (high is not None and value > high):
        raise GatewayError(400, f"{name} must be a number in [{low}, {high if high is not None else 'inf'}], "
                                f"got {value!r}", name)
    return float(value)


def opt_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise GatewayError(400, f"{name} must be a boolean, got {value!r}", name)
    return value


def stop_list(value: Any, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise GatewayError(400, f"{name} must be a string or a list of strings", name)


def text_of(content: Any, where: str) -> str:
    """Text content: a string, or a list of text parts joined (what the chat templates render)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise GatewayError(400, f"{where}[{i}]: content part type {kind!r} is not supported (text only)",
                                   f"{where}[{i}]")
        return "".join(parts)
    raise GatewayError(400, f"{where} must be a string or a list of text parts", where)
