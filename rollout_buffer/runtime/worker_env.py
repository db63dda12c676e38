"""What a worker process takes from its surroundings: the Redis it serves, and the signal that stops it.

Shared by the supervisor (`runtime.supervisor`) and the worker it starts (`runtime.worker_main`), which
starts no supervisor: kept here, the two import this module and not each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from rollout_buffer.settings import Settings
from rollout_buffer.store.embedded import SOCKET_NAME


def redis_url_of(settings: Settings) -> str | None:
    """`--redis-url`, else the embedded Redis socket of a server on this machine using the same `--data-dir`."""
    if settings.redis_url:
        return settings.redis_url
    socket_path = settings.data_dir / SOCKET_NAME
    return f"unix://{socket_path.resolve()}" if socket_path.exists() else None


def require_redis_url(settings: Settings) -> str:
    url = redis_url_of(settings)
    if url is None:
        raise SystemExit("rollout-buffer worker: give --redis-url (or --data-dir of a running server)")
    return url


def stop_event(hard_exit_after_s: float | None = None) -> asyncio.Event:
    """An event that SIGINT/SIGTERM set (call on the running loop). With `hard_exit_after_s`, a stop that
    takes longer than that ends the process anyway (SIGALRM's default action): a supervised worker must
    never outlive its parent by long, whatever its shutdown waits for."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        if hard_exit_after_s is not None:
            signal.alarm(max(1, int(hard_exit_after_s)))

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    return stop
