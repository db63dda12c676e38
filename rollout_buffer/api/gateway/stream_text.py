"""The engine's text so far as deltas of the answer the finished turn will give: reasoning, content and
tool calls, each sent once.

The text so far is cut before what may still change (a tool call whose markup has not closed, a marker
half written) and read with the run's own parser, so every call is sent when its markup closes and the
deltas add up to the finished turn's parse (`finish` sends what the partial reads held back). Content
after a tool call waits for the end (the APIs put text before calls), and anything a later read
contradicts is held to the end rather than sent twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.api.gateway.parsers import OutputParser, ParsedOutput
from rollout_buffer.tasks.chat_format import END_MARKERS, THINK_CLOSE, THINK_OPEN

_DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_HERMES = ("<tool_call>", "</tool_call>")
MARKERS = (*END_MARKERS, THINK_OPEN, THINK_CLOSE, *_DEEPSEEK, *_HERMES)
_LONGEST = max(len(m) for m in MARKERS)


@dataclass
class Delta:
    kind: str  # "reasoning", "content" or "call"
    text: str = ""
    call: dict[str, Any] = field(default_factory=dict)


def stable_prefix(text: str, parser_name: str) -> str:
    """`text` without an unclosed tool call and without a marker that may be starting at its end."""
    opener, closer = _DEEPSEEK if parser_name == "deepseekv3" else _HERMES
    at = text.rfind(opener)
    if at >= 0 and text.find(closer, at) < 0:
        text = text[:at]
    start = max(0, len(text) - _LONGEST)
    for i in range(start, len(text)):
        if text[i] == "<" and any(len(m) > len(text) - i and m.startswith(text[i:]) for m in MARKERS):
            return text[:i]
    return text


class TextStream:
    """What one streamed answer has sent so far."""

    def __init__(self, parser: OutputParser, id_prefix: str, call_array: bool) -> None:
        self.parser = parser
        self.id_prefix = id_prefix
        self.call_array = call_array
        self.reasoning = ""
        self.content = ""
        self.calls = 0

    def advance(self, text: str) -> list[Delta]:
        """The new deltas of the engine's text so far."""
        if self.call_array:
            return []
        view = self.parser.parse(stable_prefix(text, self.parser.tool_call_parser), id_prefix=self.id_prefix)
        return self._diff(view, final=False)

    def finish(self, parsed: ParsedOutput) -> list[Delta]:
        """The deltas left of the finished turn's answer."""
        return self._diff(parsed, final=True)

    def _diff(self, view: ParsedOutput, *, final: bool) -> list[Delta]:
        out: list[Delta] = []
        reasoning = view.reasoning or ""
        if len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning) \
                and not self.content and not self.calls:
            out.append(Delta("reasoning", reasoning[len(self.reasoning):]))
            self.reasoning = reasoning
        content = view.content
        if len(content) > len(self.content) and content.startswith(self.content) and (final or not self.calls):
            out.append(Delta("content", content[len(self.content):]))
            self.content = content
        for call in view.tool_calls[self.calls:]:
            out.append(Delta("call", call=call))
            self.calls += 1
        return out
