"""The Responses stream as the tokens arrive: `response.created`, a reasoning item whose summary text
comes in deltas, a message item with `response.output_text.delta` events, a `function_call` item per call
once its markup closes, then `response.completed` (or `incomplete`) holding the finished answer: the
items the finished answer is framed in (`wire_responses.events`) with the text in more pieces."""

from __future__ import annotations

from typing import Any

from rollout_buffer.api.gateway import wire_responses
from rollout_buffer.api.gateway.stream_text import Delta
from rollout_buffer.api.gateway.turns import TurnAnswer
from rollout_buffer.api.gateway.watch import Start

Event = tuple[str | None, Any]


class ResponsesStream:
    def __init__(self, start: Start, session_id: str, request: wire_responses.ResponsesRequest, model: str) -> None:
        self.begin, self.session_id, self.request, self.model = start, session_id, request, model
        self.sequence = 0
        self.position = -1  # the open item's output index
        self.open: dict[str, Any] | None = None
        self.text = ""
        self.calls = 0
        self.message_sent = False

    def _event(self, kind: str, **data: Any) -> Event:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **data}

    def start(self) -> list[Event]:
        started = {**wire_responses.started(self.session_id, self.begin.index, self.begin.created, self.request,
                                            self.model), "usage": None}
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def keepalive(self) -> list[Event]:
        """`response.in_progress` again: an event of the stream's own, which clients whose idle timer counts
        events, not SSE comments (Codex), see while a tool call's markup is being generated."""
        started = {**wire_responses.started(self.session_id, self.begin.index, self.begin.created, self.request,
                                            self.model), "usage": None}
        return [self._event("response.in_progress", response=started)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.position}

    def _open(self, item: dict[str, Any]) -> list[Event]:
        out = self._close()
        self.position += 1
        self.open, self.text = item, ""
        out.append(self._event("response.output_item.added", output_index=self.position, item=item))
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                   part={"type": "summary_text", "text": ""}))
        elif item["type"] == "message":
            self.message_sent = True
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self) -> list[Event]:
        item, text = self.open, self.text
        if item is None:
            return []
        where = self._where()
        out: list[Event] = []
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out += [self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                    self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=part)]
            done = {**item, "status": "completed", "summary": [part]}
            if "reasoning.encrypted_content" in self.request.include:
                done["encrypted_content"] = self.request.signer.seal(text)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            out += [self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", **where, content_index=0, part=part)]
            done = {**item, "status": "completed", "content": [part]}
        out.append(self._event("response.output_item.done", output_index=self.position, item=done))
        self.open = None
        return out

    def deltas(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        index = self.begin.index
        for delta in deltas:
            kind = delta.kind
            if kind == "reasoning":
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open({"type": "reasoning", "id": f"rs_{index}", "status": "in_progress",
                                       "summary": []})
                self.text += delta.text
                out.append(self._event("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                       delta=delta.text))
            elif kind == "content":
                if self.open is None or self.open["type"] != "message":
                    out += self._open({"type": "message", "id": f"msg_{index}", "status": "in_progress",
                                       "role": "assistant", "content": []})
                self.text += delta.text
                out.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                       delta=delta.text, logprobs=[]))
            else:
                out += self._call(delta.call)
        return out

    def _call(self, call: dict[str, Any]) -> list[Event]:
        name, namespace = self.request.toolset.split(call["function"]["name"])
        item = {"type": "function_call", "id": f"fc_{self.begin.index}_{self.calls}", "call_id": call["id"],
                "name": name, "arguments": call["function"]["arguments"], "status": "completed"}
        item = item if namespace is None else {**item, "namespace": namespace}
        self.calls += 1
        out = self._close()
        self.position += 1
        where = {"item_id": item["id"], "output_index": self.position}
        return [*out, self._event("response.output_item.added", output_index=self.position,
                                  item={**item, "status": "in_progress", "arguments": ""}),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=self.position, item=item)]

    def finish(self, answer: TurnAnswer) -> list[Event]:
        out = self._close()
        if not self.message_sent and not answer.parsed.tool_calls:  # an empty answer is an empty message
            out += self._open({"type": "message", "id": f"msg_{self.begin.index}", "status": "in_progress",
                               "role": "assistant", "content": []})
            out += self._close()
        final = wire_responses.response(answer, self.session_id, self.request, self.model)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=final)]
