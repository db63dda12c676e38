"""Tool-call and reasoning parsers for generated text, named as SGLang's `--tool-call-parser` and
`--reasoning-parser` name them, chosen per run (`tool_call_parser`, `reasoning_parser` in the start body).

A tool call whose markup is malformed (bad JSON, no name) stays in the text and is counted
(`malformed`): the client gets what the model wrote, never an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.api.gateway.json_limits import loads_or_raw, loose_json
from rollout_buffer.tasks.chat_format import parse_call_json, split_reasoning, strip_end_markers


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ParsedOutput:
        """A stored answer (a replayed turn) in parsed form."""
        return cls(content=str(message.get("content") or ""), reasoning=message.get("reasoning_content"),
                   tool_calls=list(message.get("tool_calls") or []))

    def message(self) -> dict[str, Any]:
        """The OpenAI-format assistant message (what the record's `messages` keep)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


Call = tuple[str, dict[str, Any]]
ToolParser = Callable[[str], tuple[str, list[Call], int]]


def _json_call(body: str) -> Call | None:
    parsed = parse_call_json(body)
    return None if parsed is None else (parsed[0], parsed[1])


def _blocks(text: str, pattern: re.Pattern[str], parse: Callable[[re.Match[str]], Call | None],
            opener: str) -> tuple[str, list[Call], int]:
    """Cut every well-formed block out of `text`; malformed ones (and unclosed openers) stay and count."""
    calls: list[Call] = []
    kept: list[str] = []
    pos = 0
    for match in pattern.finditer(text):
        call = parse(match)
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    rest = "".join(kept)
    return rest, calls, rest.count(opener)  # every opener left is a block that did not parse


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def qwen25(text: str) -> tuple[str, list[Call], int]:
    """Hermes style (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    return _blocks(text, _HERMES, lambda m: _json_call(m.group(1)), "<tool_call>")


_CODER = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _loose_value(raw: str) -> Any:
    return loads_or_raw(raw)


def qwen3_coder(text: str) -> tuple[str, list[Call], int]:
    """Qwen3-Coder XML: `<tool_call><function=name><parameter=k>v</parameter></function></tool_call>`."""
    def parse(m: re.Match[str]) -> Call | None:
        args = {p.group(1): _loose_value(p.group(2)) for p in _CODER_PARAM.finditer(m.group(2))}
        return m.group(1), args
    return _blocks(text, _CODER, parse, "<tool_call>")


_DS_CALLS = re.compile(r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", re.DOTALL)
_DS_ONE = re.compile(r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```"
                     r"\s*<｜tool▁call▁end｜>", re.DOTALL)


def deepseekv3(text: str) -> tuple[str, list[Call], int]:
    """DeepSeek-V3: calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, JSON in a code fence."""
    calls: list[Call] = []
    malformed = 0
    kept: list[str] = []
    pos = 0
    for block in _DS_CALLS.finditer(text):
        found = []
        for one in _DS_ONE.finditer(block.group(1)):
            args = loose_json(one.group(2))
            found.append((one.group(1).strip(), args) if isinstance(args, dict) else None)
        if not found or any(c is None for c in found):
            malformed += 1
            continue
        kept.append(text[pos:block.start()])
        pos = block.end()
        calls.extend(c for c in found if c is not None)
    kept.append(text[pos:])
    return "".join(kept), calls, malformed


_GLM = re.compile(r"<tool_call>([^\n<]+)\n?(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm45(text: str) -> tuple[str, list[Call], int]:
    """GLM-4.5: `<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`."""
    def parse(m: re.Match[str]) -> Call | None:
        name = m.group(1).strip()
        if not name:
            return None
        return name, {a.group(1).strip(): _loose_value(a.group(2)) for a in _GLM_ARG.finditer(m.group(2))}
    return _blocks(text, _GLM, parse, "<tool_call>")


def parse_call_array(text: str) -> list[Call] | None:
    """`[{"name": ..., "parameters": {...}}, ...]` (what SGLang's forced-call constraint makes the model
    write) as calls; None when the text is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("parameters"), dict)
            for v in value):
        return None
    return [(v["name"], v["parameters"]) for v in value]


TOOL_CALL_PARSERS: dict[str, ToolParser] = {"qwen25": qwen25, "qwen": qwen25, "hermes": qwen25,
                                            "qwen3_coder": qwen3_coder, "deepseekv3": deepseekv3, "glm45": glm45}
REASONING_PARSERS = ("qwen3", "deepseek-r1", "think", "none")


@dataclass(frozen=True)
class OutputParser:
    """The parsers one run uses."""

    tool_call_parser: str = "qwen25"
    reasoning_parser: str = "qwen3"

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    def parse(self, text: str, *, id_prefix: str, call_array: bool = False) -> ParsedOutput:
        """`call_array`: the generation was constrained to a JSON array of calls (a forced tool call,
        `constraints.forced_calls`), read as such when it is one."""
        text = strip_end_markers(text)
        reasoning = None
        if self.reasoning_parser != "none":
            reasoning, text = split_reasoning(text)
        array = parse_call_array(text) if call_array else None
        if array is not None:
            rest, calls, malformed = "", array, 0
        else:
            rest, calls, malformed = TOOL_CALL_PARSERS[self.tool_call_parser](text)
        tool_calls = [{"id": f"{id_prefix}_{i}", "type": "function",
                       "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                      for i, (name, args) in enumerate(calls)]
        return ParsedOutput(content=rest.strip(), reasoning=reasoning, tool_calls=tool_calls, malformed=malformed)
