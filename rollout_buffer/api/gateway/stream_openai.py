"""Chat Completions' stream as the tokens arrive: `chat.completion.chunk` objects for the role, each
reasoning and content delta, each tool call once its markup closes, then the finish and usage, the same
chunks the finished answer is framed in (`wire_openai.chunks`) with the text in more pieces."""

from __future__ import annotations

from typing import Any

from rollout_buffer.api.gateway import wire_openai
from rollout_buffer.api.gateway.stream_text import Delta
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.watch import Start

Event = tuple[str | None, Any]


class ChatStream:
    def __init__(self, start: Start, session_id: str, model: str, include_usage: bool) -> None:
        self.head = {"id": f"chatcmpl-{session_id.rpartition('~')[2]}-{start.index}",
                     "object": "chat.completion.chunk", "created": start.created, "model": model}
        self.include_usage = include_usage
        self.calls = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Event:
        extra = {"usage": None} if self.include_usage else {}
        return None, {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}], **extra}

    def start(self) -> list[Event]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> list[Event]:
        """None: Chat Completions has no keep-alive event, and its clients' read timeouts count bytes, which
        the stream's keep-alive comments are."""
        return []

    def deltas(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        for delta in deltas:
            if delta.kind == "reasoning":
                out.append(self._chunk({"reasoning_content": delta.text}))
            elif delta.kind == "content":
                out.append(self._chunk({"content": delta.text}))
            else:
                function, index = delta.call["function"], self.calls
                self.calls += 1
                out.append(self._chunk({"tool_calls": [{"index": index, "id": delta.call["id"], "type": "function",
                                                        "function": {"name": function["name"], "arguments": ""}}]}))
                out.append(self._chunk({"tool_calls": [{"index": index,
                                                        "function": {"arguments": function["arguments"]}}]}))
        return out

    def finish(self, answer: TurnAnswer) -> list[Event]:
        out = [self._chunk({}, wire_openai.finish_reason(answer))]
        if self.include_usage:
            out.append((None, {**self.head, "choices": [], "usage": wire_openai.usage(answer)}))
        return [*out, (None, "[DONE]")]
