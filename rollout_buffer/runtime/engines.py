"""Which engine a rollout talks to, when a run names several (`remote_engine_url` as a list, no router).

A router (`sglang-router`) in front of the engines is the first choice: one URL, and it balances, keeps a
session on one engine (`X-SMG-Routing-Key`) and drops dead engines itself. For users without one, a run
may list the engine URLs; then each worker process deals rollouts out round robin, and a rollout stays on
its engine for all its turns (its prefix stays in that engine's cache). A call that fails in a way worth
retrying (connection refused, 5xx, timeout) moves that rollout to the next engine for its retry, and new
rollouts skip the failed engine for `cooldown_s`; when every engine failed recently they are all tried
again. With one URL all of this is a no-op.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

COOLDOWN_S = 10.0


@dataclass
class EngineRing:
    """The engines of one run in one worker process: round robin by rollout, failed engines cooled down."""

    urls: tuple[str, ...]
    cooldown_s: float = COOLDOWN_S
    _next: int = field(default=-1)
    _down_until: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no engine URL")
        if self._next < 0:  # processes start at different engines, so a few rollouts each still spread
            self._next = random.randrange(len(self.urls))

    def pick(self) -> EngineChoice:
        """The engine for a new rollout: the next one in turn that has not failed lately."""
        index = self._healthy_from(self._next)
        self._next = (index + 1) % len(self.urls)
        return EngineChoice(self, index)

    def _healthy_from(self, start: int) -> int:
        now = time.monotonic()
        for step in range(len(self.urls)):
            index = (start + step) % len(self.urls)
            if self._down_until.get(index, 0.0) <= now:
                return index
        return start % len(self.urls)  # all failed lately: try them anyway, in turn

    def failed(self, index: int) -> None:
        if len(self.urls) > 1:
            self._down_until[index] = time.monotonic() + self.cooldown_s


@dataclass
class EngineChoice:
    """One rollout's engine: the same for all its turns, moved on only when a call to it fails."""

    ring: EngineRing
    index: int

    @property
    def url(self) -> str:
        return self.ring.urls[self.index]

    def failover(self) -> None:
        """The current engine failed a call: mark it, and send this rollout's next attempt elsewhere."""
        if len(self.ring.urls) > 1:
            self.ring.failed(self.index)
            self.index = self.ring._healthy_from(self.index + 1)


def single(url: str) -> EngineChoice:
    """A choice of exactly one engine (or router)."""
    return EngineRing((url.rstrip("/"),)).pick()
