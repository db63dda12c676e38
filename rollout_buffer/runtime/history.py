"""The append-only rule for one rollout's conversation.

An engine client has already turned every earlier message into tokens; a task that edits, drops or
reorders them would make the recorded tokens disagree with the recorded messages, and no exact loss mask
could follow. So every call's messages must start with exactly what the previous call saw plus the
assistant message it returned, and the tool list must not change.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_buffer.tasks.contract import HistoryRewriteError


def snapshot(value: Any) -> Any:
    """A deep copy (JSON round trip) that later edits by the task cannot reach."""
    return orjson.loads(orjson.dumps(value))


class HistoryGuard:
    """Remembers what the engine saw and raises HistoryRewriteError on any rewrite.

    Each call copies only the messages it adds, when the call begins (what the engine is about to see): the
    earlier ones are already copied and checked equal, and copying the whole conversation every turn made a
    rollout's cost grow with the square of its length."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] | None = None
        self.tools: list[dict[str, Any]] | None = None
        self._pending: tuple[int, list[dict[str, Any]], list[dict[str, Any]] | None] | None = None

    @property
    def started(self) -> bool:
        return self.seen is not None

    def new_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The messages appended since the previous call (all of them on the first call)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages")
        if self.seen is None:
            new = list(messages)
            self._pending = (len(messages), snapshot(new), snapshot(tools) if tools else None)
            return new
        if (tools or None) != self.tools:
            raise HistoryRewriteError("the tool list changed between engine calls of one rollout")
        known = len(self.seen)
        if len(messages) <= known:
            raise HistoryRewriteError(
                f"chat() got {len(messages)} messages but the previous call already saw {known} "
                "(history must grow: append the returned assistant message and the new messages)")
        for index in range(known):
            if messages[index] != self.seen[index]:
                role = self.seen[index].get("role")
                raise HistoryRewriteError(
                    f"messages[{index}] ({role}) differs from what the engine already saw; history is append-only")
        new = list(messages[known:])
        self._pending = (len(messages), snapshot(new), self.tools)
        return new

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               assistant: dict[str, Any]) -> None:
        """Remember the call's messages (as copied when it began) and the assistant message it returned."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == len(messages):
            self.seen = [*(self.seen or []), *pending[1], *snapshot([assistant])]
            self.tools = pending[2]
        else:  # record() without new_messages(): copy everything now
            self.seen = snapshot([*messages, assistant])
            self.tools = snapshot(tools) if tools else None

    def conversation(self) -> list[dict[str, Any]]:
        """Everything seen so far, for failure records."""
        return snapshot(self.seen or [])
