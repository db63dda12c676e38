"""Injected faults: which one a generation request gets, and what it does to the answer.

Counts come first (`fail_next`, `hang_next`, `abort_next`, `malformed_next`: exactly the next N requests),
then rates (one seeded draw per request, so a seed reproduces the sequence). An error answers 500, a hang
holds the request until the engine stops (503), an abort cuts the output short with finish reason
`abort`, and a malformed answer is a 200 whose body is half a JSON document or an HTML error page.
Everything injected is counted in the engine's stats.
"""

from __future__ import annotations

import asyncio
import random
import threading

from aiohttp import web

from rollout_buffer.testing.engine.config import EngineConfig
from rollout_buffer.testing.engine.http_server import json_response
from rollout_buffer.testing.engine.stats import EngineStats

ABORT_MESSAGE = "Injected abort (test engine fault)"


class Fault:
    NONE = "none"
    ERROR = "error"
    ABORT = "abort"
    HANG = "hang"
    MALFORMED = "malformed"


# (fault, its exact-count knob, its rate knob), in the order they are checked
_KNOBS = (
    (Fault.ERROR, "fail_next", "error_rate"),
    (Fault.HANG, "hang_next", "hang_rate"),
    (Fault.ABORT, "abort_next", "abort_rate"),
    (Fault.MALFORMED, "malformed_next", "malformed_rate"),
)


class FaultInjector:
    """Picks and applies faults for one engine; shares the engine's config, stats and lock."""

    def __init__(self, config: EngineConfig, stats: EngineStats, lock: threading.Lock) -> None:
        self.config = config
        self.stats = stats
        self._lock = lock
        self._rng = random.Random(config.seed)

    def reseed(self) -> None:
        """Restart the rate draws from the config's seed (the caller holds the lock)."""
        self._rng = random.Random(self.config.seed)

    def pick(self) -> str:
        """This request's fault: the first pending count, else one draw against the rates stacked in order."""
        with self._lock:
            cfg = self.config
            for fault, count_key, _ in _KNOBS:
                left = getattr(cfg, count_key)
                if left > 0:
                    setattr(cfg, count_key, left - 1)
                    return fault
            draw = self._rng.random()
            for fault, _, rate_key in _KNOBS:
                rate = getattr(cfg, rate_key)
                if draw < rate:
                    return fault
                draw -= rate
            return Fault.NONE

    async def answer_instead(self, fault: str, closing: asyncio.Event) -> web.Response:
        """The answer an error (500 at once) or a hang (503 when `closing` is set) gives instead of generating."""
        if fault == Fault.ERROR:
            with self._lock:
                self.stats.errors_injected += 1
            return json_response({"error": {"message": "Injected internal error (test engine fault)"}}, 500)
        with self._lock:
            self.stats.hangs += 1
        await closing.wait()
        return json_response({"error": {"message": "Server is shutting down"}}, 503)

    def abort_at(self, count: int, rng: random.Random) -> int:
        """How many of `count` planned tokens an injected abort lets out (fewer, at least one where possible)."""
        with self._lock:
            self.stats.aborts += 1
            self.stats.aborts_injected += 1
        return rng.randint(1, count - 1) if count > 1 else 0

    def malformed(self, body: bytes) -> web.Response:
        """A 200 that no JSON parser accepts: the first half of the body, or an HTML gateway error."""
        with self._lock:
            self.stats.malformed += 1
        cut = body[: max(1, len(body) // 2)] if len(body) % 2 else b"<html>502 Bad Gateway</html>"
        return web.Response(body=cut, status=200, content_type="application/json")

