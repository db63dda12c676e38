"""Anthropic's message stream as the tokens arrive: `message_start`, a thinking block whose deltas come as
the model thinks (signed when it closes), a text block, a `tool_use` block per call once its markup
closes, then `message_delta` with the stop reason and usage: the events the finished answer is framed in
(`wire_anthropic.events`) with the text in more pieces."""

from __future__ import annotations

import json
from typing import Any

from rollout_buffer.api.gateway import wire_anthropic
from rollout_buffer.api.gateway.signing import Signer
from rollout_buffer.api.gateway.stream_text import Delta
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.watch import Start

Event = tuple[str | None, Any]


class MessagesStream:
    def __init__(self, start: Start, session_id: str, model: str, signer: Signer) -> None:
        self.message = {"id": f"msg_{session_id.rpartition('~')[2]}_{start.index}", "type": "message",
                        "role": "assistant", "model": model, "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": {"input_tokens": start.prompt_tokens, "output_tokens": 1}}
        self.signer = signer
        self.index = -1  # the open block's
        self.open: str | None = None
        self.thinking = ""

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": self.message})]

    def keepalive(self) -> list[Event]:
        """Anthropic's own keep-alive event (clients skip it)."""
        return [("ping", {"type": "ping"})]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block}))
        if self.index == 0:
            out.append(("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self.signer.sign(self.thinking)}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def deltas(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        for delta in deltas:
            if delta.kind == "reasoning":
                if self.open != "thinking":
                    out.extend(self._open({"type": "thinking", "thinking": "", "signature": ""}))
                self.thinking += delta.text
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
            elif delta.kind == "content":
                if self.open != "text":
                    out.extend(self._open({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": delta.text}))
            else:
                call = delta.call
                out.extend(self._open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                       "input": {}}))
                arguments = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
                out.extend(self._close())
        return out

    def finish(self, answer: TurnAnswer) -> list[Event]:
        return [*self._close(),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": wire_anthropic.stop_reason(answer), "stop_sequence": None},
                                   "usage": {"output_tokens": answer.completion_tokens}}),
                ("message_stop", {"type": "message_stop"})]
