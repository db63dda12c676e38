"""Keeping the leases of batches the adapter holds: read, not yet acknowledged.

A step can take longer than `agent_lease_s` (waiting for more groups, building samples). A lease that runs
out gives its groups back to the buffer, and another read would get them again, so while a batch is held
a background task renews its lease every `lease_s / 3` (`POST /ack` with `"renew": true`), each call with
a timeout, until the batch is acknowledged. A batch the buffer no longer holds for this reader (acked,
expired and read by someone else, unknown) is not renewed again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from slime_adapter.reading.buffer_client import ack_batches

log = logging.getLogger(__name__)

Held = Callable[[], tuple[str | None, list[str]]]  # (run id, batch ids held now)


async def renew_while_held(buffer_url: str, lease_s: float, held: Held, *, timeout_s: float = 30.0) -> int:
    """Renew the held batches' leases every `lease_s / 3` until none is held; returns how many renewals
    the buffer confirmed. Failures are logged and tried again at the next interval."""
    interval = lease_s / 3
    given_up: set[str] = set()
    renewed = 0
    while True:
        await asyncio.sleep(interval)
        run_id, batch_ids = held()
        live = [b for b in batch_ids if b not in given_up]
        if not live:
            return renewed
        try:
            outcomes = await ack_batches(buffer_url, live, run_id=run_id, timeout=min(timeout_s, interval),
                                         attempts=1, renew=True)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("renewing the leases of %d batch(es) failed (%s); trying again in %.3g s", len(live),
                        exc, interval)
            continue
        for batch_id, outcome in outcomes.items():
            if outcome == "renewed":
                renewed += 1
            else:
                given_up.add(batch_id)
                if outcome != "already_acked":
                    log.warning("batch %s could not be renewed: %s (its groups may be handed over again)",
                                batch_id, outcome)


class LeaseKeeper:
    """At most one renewal task per adapter state, started when a batch is held and ended with it."""

    def __init__(self) -> None:
        self._task: asyncio.Task[int] | None = None

    def keep(self, buffer_url: str, lease_s: float, held: Held) -> None:
        """Start renewing (on the running loop) unless a renewal task is already running."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(renew_while_held(buffer_url, lease_s, held))

    def stop(self) -> None:
        """Cancel the renewal task (thread-safe: a fresh trainer state forgets its predecessor's batches)."""
        task = self._task
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._task = None
