"""Structured output in the test engine: a scripted answer reshaped to fit `sampling_params.json_schema`,
as SGLang's grammar backend would force the model to write it.

The scripted text is kept where it fits: a forced tool-call array (`[{"name", "parameters"}]`, what
SGLang's OpenAI server asks for a required or named tool call) carries the scripted call when its name is
allowed, else the first allowed function with arguments built from its schema; any other schema gets an
instance built from it, numbers taken from the scripted answer (so `{"answer": 42}` follows
"The answer is \\boxed{42}"). `ebnf` and `regex` constraints are recorded, not applied.
"""

from __future__ import annotations

import json
import re
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _number(script: str) -> float:
    found = _NUMBER.findall(script)
    return float(found[-1]) if found else 0.0


def instance(schema: Any, script: str) -> Any:
    """A value of `schema` (the common JSON Schema keywords), numbers from `script`."""
    if not isinstance(schema, dict):
        return {}
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance({**schema[key][0], **{k: v for k, v in schema.items() if k != key}}, script)
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "integer":
        return int(_number(script))
    if kind == "number":
        value = _number(script)
        return int(value) if value.is_integer() else value
    if kind == "boolean":
        return True
    if kind == "string":
        return script.strip()[:80]
    if kind == "null":
        return None
    if kind == "array":
        return [instance(schema.get("items"), script) for _ in range(max(1, int(schema.get("minItems") or 1)))]
    properties = schema.get("properties") or {}
    names = schema.get("required") or list(properties)
    return {name: instance(properties.get(name), script) for name in names}


def _call_options(items: Any) -> list[dict[str, Any]]:
    """The `{"name": enum, "parameters": schema}` alternatives of a call-array item schema."""
    options = items.get("anyOf") if isinstance(items, dict) and items.get("anyOf") else [items]
    return [o for o in options if isinstance(o, dict) and "name" in (o.get("properties") or {})]


def constrained(script: str, json_schema: Any) -> str:
    """`script` rewritten to match `json_schema` (a JSON text or an object)."""
    schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
    options = _call_options(schema.get("items")) if isinstance(schema, dict) and schema.get("type") == "array" else []
    if not options:
        return json.dumps(instance(schema, script), ensure_ascii=False)
    allowed = {o["properties"]["name"].get("enum", [None])[0]: o for o in options}
    match = _CALL.search(script)
    call = json.loads(match.group(1)) if match else {}
    if call.get("name") in allowed:
        chosen = {"name": call["name"], "parameters": call.get("arguments") or {}}
    else:
        name, option = next(iter(allowed.items()))
        chosen = {"name": name, "parameters": instance(option["properties"].get("parameters"), script)}
    return json.dumps([chosen], ensure_ascii=False)
