"""What a streamed turn shows while it runs: where it starts (its number, its prompt) and the engine's text
so far. `run_turn` fills it in; the stream that forwards the tokens reads it (the latest text only: a slow
client gets the text in bigger pieces, never a backlog). Each engine chunk only marks the watch changed: the
text is read from the engine client's reader when the stream flushes, not per chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Start:
    index: int  # the turn's number as the session's probe saw it (ids of the answer's items)
    prompt_tokens: int
    call_array: bool  # a forced call: the text is a JSON array of calls, read only at the end
    created: int = field(default_factory=lambda: int(time.time()))


class TurnWatch:
    def __init__(self) -> None:
        self.start: Start | None = None
        self._read: Callable[[], str] | None = None
        self.chunks = 0  # the engine's chunks so far: the first starts the client's stream, text or not
        self.generated = False  # the engine has answered: the turn is being stored, a leaving client keeps it
        self.changed = asyncio.Event()
        self.on_first: Callable[[], None] | None = None  # told of the first chunk (the stream may start)

    def started(self, start: Start) -> None:
        self.start = start
        self.changed.set()

    @property
    def text(self) -> str:
        """The engine's text so far."""
        return "" if self._read is None else self._read()

    def on_text(self, read: Callable[[], str]) -> None:
        """One more engine chunk; `read` reads the text so far."""
        self._read = read
        self.chunks += 1
        self.changed.set()
        if self.chunks == 1 and self.on_first is not None:
            self.on_first()
