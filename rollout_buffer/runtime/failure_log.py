"""Logging failed rollouts without flooding the log: one line per new error type, then periodic counts.

A run whose every rollout fails (a bad data file, a dead engine) used to log one identical warning per
rollout. Now each worker process logs, per run, one warning the first time the run meets an error type
(only the process that stores the type's first example in Redis logs it, so a type is announced once
however many workers there are), and at most one summary per `interval_s` with the counts since the last
one. The full counts and examples are in `GET /runs/{run_id}` (`rollout_buffer.metrics.failures`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.metrics.failures import record_example
from rollout_buffer.security.redaction import redact
from rollout_buffer.store.redis_client import RedisClient

log = logging.getLogger(__name__)
SUMMARY_INTERVAL_S = 30.0


@dataclass
class FailureLog:
    """The failure log of one run in one process (see the module docstring)."""

    run_id: str
    interval_s: float = SUMMARY_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    logger: logging.Logger = log
    since_summary: Counter[str] = field(default_factory=Counter)
    last_summary: float | None = None

    async def note(self, client: RedisClient, record: dict[str, Any]) -> None:
        """Account for one `failed` record: keep the first example of its type, log as described above."""
        info = record.get("extra_info") or {}
        error_type = str(info.get("error_type") or "unknown")
        message = redact(str(info.get("error") or ""))
        if await record_example(client, self.run_id, error_type, message, str(record.get("uid", ""))):
            self.logger.warning("run %s: rollouts fail with a new error type %s (first: %s): %s "
                                "(counts per type: GET /runs/%s)", self.run_id, error_type, record.get("uid"),
                                message[:500], self.run_id)
        self.since_summary[error_type] += 1
        now = self.clock()
        if self.last_summary is None:
            self.last_summary = now
        elif now - self.last_summary >= self.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log the counts since the last summary (nothing when there were none)."""
        now = self.clock() if now is None else now
        if self.since_summary:
            counts = ", ".join(f"{name} x{n}" for name, n in self.since_summary.most_common())
            elapsed = now - (self.last_summary if self.last_summary is not None else now)
            self.logger.warning("run %s: %d rollout(s) failed in the last %.0f s: %s", self.run_id,
                                sum(self.since_summary.values()), elapsed, counts)
        self.since_summary.clear()
        self.last_summary = now
