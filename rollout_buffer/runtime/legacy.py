"""slime-style task modules: `run_rollout(data)` is synchronous and writes its own records over HTTP.

It runs in a dedicated thread (never the event loop, never the shared executor, which tokenizer loads and
file reads need), so a module written for slime's buffer works unchanged and cannot block the server.
The runner keeps only live threads: a run's entry is dropped when its `run_rollout` returns, so a server
that runs thousands of legacy runs over its life holds nothing for the finished ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from rollout_buffer.runs.lifecycle import RunSpec
from rollout_buffer.store import keys
from rollout_buffer.store.store import Store

log = logging.getLogger(__name__)


class LegacyRunner:
    """At most one live `run_rollout` thread per run; the run is marked finished (or failed) when it returns."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._threads: dict[str, threading.Thread] = {}
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def live_runs(self) -> list[str]:
        """Runs whose `run_rollout` thread is tracked (running, or just returned)."""
        return sorted(self._threads)

    def running(self, run_id: str) -> bool:
        thread = self._threads.get(run_id)
        return thread is not None and thread.is_alive()

    def launch(self, spec: RunSpec, write_url: str | None = None) -> bool:
        """Start the module's `run_rollout` for this run unless it is already running; True if started.
        `write_url` is the `remote_buffer_url` the module gets (default: the run's own URL, no write key)."""
        if self.running(spec.run_id):
            return False
        payload: dict[str, Any] = spec.request.model_dump()
        payload["run_id"] = spec.run_id
        # slime's form: one entry per trained group (its generator skips an id once per listed entry)
        payload["skip_instance_ids"] = sorted(keys.parse_gid(g)[1] for g in spec.excluded_groups)
        # writes through a URL that names this run: once the run is superseded or deleted, a thread still
        # running (threads cannot be stopped) has its late writes refused and counted, not mixed into the
        # active run
        payload["remote_buffer_url"] = write_url or f"{spec.request.remote_buffer_url.rstrip('/')}/runs/{spec.run_id}"
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()
        function = spec.task.module.run_rollout

        def report(error: BaseException | None) -> None:
            if not done.done():
                done.set_result(error)

        def body() -> None:
            error: BaseException | None = None
            try:
                function(payload)
            except BaseException as exc:  # noqa: BLE001 - reported to the loop; a thread has nobody else to tell
                error = exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(report, error)

        thread = threading.Thread(target=body, name=f"legacy-rollout-{spec.run_id}", daemon=True)
        self._threads[spec.run_id] = thread
        thread.start()
        watcher = loop.create_task(self._finish(spec.run_id, thread, done))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return True

    async def _finish(self, run_id: str, thread: threading.Thread,
                      done: asyncio.Future[BaseException | None]) -> None:
        error = await done
        if self._threads.get(run_id) is thread:  # not a newer thread of a relaunch
            del self._threads[run_id]
        if error is None:
            log.info("legacy rollout of run %s returned", run_id)
            await self.store.set_run_status(run_id, "finished")
            return
        log.error("legacy rollout of run %s raised %s: %s", run_id, type(error).__name__, error)
        await self.store.incr_stat(run_id, f"legacy_errors:{type(error).__name__}")
        await self.store.set_run_status(run_id, "failed")

    async def shutdown(self) -> None:
        """Threads cannot be stopped from outside; they are daemons and die with the process."""
        for watcher in list(self._watchers):
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
