"""The fault scheduler: which fault lands when, driven by one seed.

Every kind runs on its own thread, so faults of different kinds overlap (an API restarting while the
trainer is killed and the engine errs), as they do in a real outage: a kind waits a seeded gap in
[`min_gap_s`, `max_gap_s`] after its previous fault *started* (a slow fault, such as an API restart or a
failover, eats into its own gap, not into the other kinds'), then its injector (a callable the harness
supplies) runs and returns whether the fault landed. One that found nothing to hit (no trainer process
between rounds, a redis-server mid-restart) is counted as skipped, not injected, and tried again after
`retry_s`. Each kind's gaps come from its own generator seeded by (seed, kind): the same seed gives the
same gaps; what they hit depends on timing.
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
    min_gap_s: float = 0.8
    max_gap_s: float = 3.6
    retry_s: float = 0.2
    # kinds with gaps of their own: faults armed for the next request that can take them (proxy, engine)
    # land some time after they are armed, and a trainer kill waits for the trainer's next checkpoint, so
    # they are tried more often to land about as often as the rest
    gap_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    history: list[tuple[float, str, bool, float]] = field(default_factory=list)  # (t, kind, landed, took)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gaps(self, kind: str) -> Iterator[float]:
        """The seeded gaps of one kind, forever."""
        rng = random.Random(f"{self.seed}/{kind}")
        low, high = self.gap_s.get(kind, (self.min_gap_s, self.max_gap_s))
        while True:
            yield rng.uniform(low, high)

    def run(self) -> None:
        """Every kind on its own thread until `stop` is set; returns once they all stopped."""
        threads = [threading.Thread(target=self._kind, args=(kind,), name=f"fault-{kind}", daemon=True)
                   for kind in sorted(self.injectors)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _kind(self, kind: str) -> None:
        started = time.monotonic()
        last = started
        for gap in self.gaps(kind):
            if self.stop.wait(max(0.0, last + gap - time.monotonic())):
                return
            while True:
                last = time.monotonic()
                try:
                    landed = self.injectors[kind]()
                except Exception:  # an injector that failed is a harness problem: recorded, reported
                    self.errors.append(f"{kind}: {traceback.format_exc(limit=3)}")
                    landed = False
                with self._lock:
                    (self.injected if landed else self.skipped)[kind] += 1
                    self.history.append((last - started, kind, landed, time.monotonic() - last))
                if landed or self.stop.wait(self.retry_s):
                    break
            if self.stop.is_set():
                return
