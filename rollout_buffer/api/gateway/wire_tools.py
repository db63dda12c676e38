"""Tools the model cannot call through this gateway, and tools that come grouped.

Hosted tools (OpenAI's `web_search`, `file_search`, `code_interpreter`, `mcp`, ...; Anthropic's server
tools such as `web_search_20250305`) run on the vendor's servers, which this gateway is not: they are left
out of the prompt and counted per type (`gateway_ignored_tools:<label>`), the label from a fixed list so
that a client cannot mint counters. Codex sends one (`web_search`) in its default request.

A Responses `namespace` tool (`{"type": "namespace", "name": "multi_agent_v1", "tools": [...]}`, Codex's
sub-agent tools) is flattened: the model sees each inner function as `<namespace>.<name>` (the name OpenAI's
own rendering gives it), and a call of such a name goes back to the client as OpenAI returns it: a
`function_call` item with `name` the inner name and `namespace` the group's (codex-rs routes on the pair).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.api.gateway.errors import GatewayError

# OpenAI Responses / Chat tool types that are not client functions
OPENAI_HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use",
                 "computer_use_preview", "computer", "image_generation", "mcp", "local_shell", "shell",
                 "apply_patch", "custom", "tool_search")
# Anthropic tool types (dated versions such as `web_search_20250305` keep the part before the date)
ANTHROPIC_HOSTED = ("web_search", "web_fetch", "code_execution", "bash", "text_editor", "computer", "memory",
                    "tool_search_tool_regex", "tool_search_tool_bm25", "mcp_toolset")
_DATED = re.compile(r"^(.*?)_(\d{8})$")
SEPARATOR = "."


def openai_label(kind: Any) -> str:
    """The counter label of a non-function OpenAI tool type: one of `OPENAI_HOSTED`, or `other`."""
    return kind if isinstance(kind, str) and kind in OPENAI_HOSTED else "other"


def anthropic_label(kind: Any) -> str:
    """The counter label of an Anthropic server tool type (`web_search_20250305` -> `web_search`)."""
    if not isinstance(kind, str):
        return "other"
    dated = _DATED.match(kind)
    base = dated.group(1) if dated else kind
    return base if base in ANTHROPIC_HOSTED else "other"


def ignored_counters(labels: list[str]) -> dict[str, int]:
    counters: dict[str, int] = {}
    for label in labels:
        counters[f"gateway_ignored_tools:{label}"] = counters.get(f"gateway_ignored_tools:{label}", 0) + 1
    return counters


@dataclass
class ToolSet:
    """A request's tools as the chat template renders them, what was left out, and the namespace groups."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)

    def split(self, flat: str) -> tuple[str, str | None]:
        """A generated call's name as the client knows it: (name, namespace or None)."""
        found = self.namespaces.get(flat)
        return (found[1], found[0]) if found else (flat, None)


def flat_name(name: str, namespace: Any) -> str:
    """The name the model saw for a call the client sends back (Responses `function_call.namespace`)."""
    return f"{namespace}{SEPARATOR}{name}" if isinstance(namespace, str) and namespace else name


def _function(tool: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise GatewayError(400, f"{where}: a function tool needs a name", where)
    function = {"name": prefix + tool["name"],
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def responses_tools(raw: Any) -> ToolSet:
    """Responses `tools`: functions kept, namespaces flattened, everything else left out and labelled."""
    out = ToolSet()
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise GatewayError(400, "tools must be a list", "tools")
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise GatewayError(400, f"{where} must be an object", where)
        kind = tool.get("type")
        if kind == "function":
            out.tools.append(_function(tool, where))
        elif kind == "namespace":
            group, inner = tool.get("name"), tool.get("tools")
            if not isinstance(group, str) or not group or not isinstance(inner, list):
                raise GatewayError(400, f"{where}: a namespace tool needs a name and a list of tools", where)
            for k, member in enumerate(inner):
                if not isinstance(member, dict) or member.get("type") != "function":
                    out.ignored.append(openai_label(member.get("type") if isinstance(member, dict) else None))
                    continue
                flat = _function(member, f"{where}.tools[{k}]", group + SEPARATOR)
                out.tools.append(flat)
                out.namespaces[flat["function"]["name"]] = (group, member["name"])
        else:
            out.ignored.append(openai_label(kind))
    return out
