"""The fault scheduler: which fault lands when, driven by one seed.

Faults come in cycles: each cycle is a seeded permutation of every kind, so a short run still injects
every kind, and the gaps between faults are seeded draws in [`min_gap_s`, `max_gap_s`]. Each kind is an
injector (a callable the harness supplies) that returns whether the fault landed (a worker being
restarted has no process to kill yet: that draw is counted as skipped, not as injected, and the kind is
tried again at the next slot, the planned kind waiting its turn).
The same seed gives the same sequence of kinds and gaps; what they hit depends on timing.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Injector = Callable[[], bool]


@dataclass
class FaultScheduler:
    seed: int
    injectors: dict[str, Injector]
    min_gap_s: float = 0.5
    max_gap_s: float = 2.5
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    history: list[tuple[float, str, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def plan(self) -> Iterator[tuple[str, float]]:
        """(kind, gap before it) forever: the seeded sequence."""
        rng = random.Random(self.seed)
        kinds = sorted(self.injectors)
        while True:
            cycle = kinds[:]
            rng.shuffle(cycle)
            for kind in cycle:
                yield kind, rng.uniform(self.min_gap_s, self.max_gap_s)

    def run(self) -> None:
        started = time.monotonic()
        retry: list[str] = []  # kinds that found nothing to hit: tried again before the plan goes on
        for planned, gap in self.plan():
            kind = retry.pop(0) if retry else planned
            if kind != planned:
                retry.append(planned)
            if self.stop.wait(gap):
                return
            try:
                landed = self.injectors[kind]()
            except Exception:  # an injector that failed is a harness problem: recorded, reported
                self.errors.append(f"{kind}: {traceback.format_exc(limit=3)}")
                landed = False
            (self.injected if landed else self.skipped)[kind] += 1
            if not landed and kind not in retry:
                retry.append(kind)
            self.history.append((time.monotonic() - started, kind, landed))

