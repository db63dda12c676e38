"""Structured output, enforced the way SGLang's OpenAI server enforces it: a constraint sent with the
generation (`json_schema` in the sampling parameters, which SGLang's grammar backend applies).

- A forced tool call (`tool_choice` `"required"`, or one named function; Anthropic's `any` / `tool`) is a
  JSON array of `{"name", "parameters"}` objects (one object and `maxItems: 1` for a named function or
  `parallel_tool_calls: false`), each name one of the request's functions with its parameter schema. The
  model writes that array instead of its own call markup, and the turn reads it as the calls
  (`parsers.parse_call_array`): the tokens stay the engine's own.
- A JSON answer (Chat `response_format`, Responses `text.format`: `json_schema` with its schema, or
  `json_object`) is the schema itself (`{"type": "object"}` for `json_object`).

A constraint that cannot apply (no tools, a function that is not offered, a schema that is not an object)
is a 400 naming the field, never a silent free-form generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rollout_buffer.api.gateway.errors import GatewayError


@dataclass(frozen=True)
class Constraint:
    """What a request adds to the sampling parameters, and whether its answer is a call array."""

    json_schema: str | None = None
    calls: bool = False

    def params(self) -> dict[str, Any]:
        return {"json_schema": self.json_schema} if self.json_schema is not None else {}


NONE = Constraint()


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                             "parameters": parameters},
            "required": ["name", "parameters"]}


def forced_calls(tools: list[dict[str, Any]] | None, name: str | None, *, parallel: bool = True,
                 field: str = "tool_choice") -> Constraint:
    """The constraint of a forced call: any of `tools` (`name` None) or the one named."""
    functions = [t["function"] for t in tools or []]
    if not functions:
        raise GatewayError(400, f"{field}: a forced tool call needs tools", field)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise GatewayError(400, f"{field}: function {name!r} is not one of the request's tools", field)
    items = _call_schema(functions[0]) if len(functions) == 1 else \
        {"type": "object", "anyOf": [_call_schema(f) for f in functions]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if name is not None or not parallel:
        schema["maxItems"] = 1
    return Constraint(json_schema=orjson.dumps(schema).decode(), calls=True)


def json_answer(kind: Any, schema: Any, field: str) -> Constraint:
    """The constraint of a `json_schema` / `json_object` / `text` answer format."""
    if kind in (None, "text"):
        return NONE
    if kind == "json_object":
        return Constraint(json_schema='{"type":"object"}')
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise GatewayError(400, f"{field}: a json_schema format needs its schema (an object)", field)
        return Constraint(json_schema=orjson.dumps(schema).decode())
    raise GatewayError(400, f"{field}.type must be one of text, json_object, json_schema", f"{field}.type")
