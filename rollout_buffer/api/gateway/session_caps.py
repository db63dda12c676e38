"""Bounded sessions: caps on one session's turns, forks and stored bytes, and on the sessions open at once in
a run and in the whole server. Each refusal names its cap and flag: a session at a cap is 409 (finish it,
start another: waiting does not help), too many open sessions is 429 with `Retry-After` (sessions finish).

A session's fork and byte counts live beside its history index (`sessions.usage_fields`; exact lookups
only), so they go with the run; its turn count is the store's own. The turn's own round trips read them
(`SessionStore.probe`) and add to them (the turn's store script), so the caps cost no round trip of their own.
The bytes are what Redis holds of each turn (its packed form): a fork counts what it adds, not the prompt it
shares with an earlier turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_buffer.api.gateway.context import Gateway
from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.runs import retention
from rollout_buffer.settings import Settings
from rollout_buffer.store import keys


@dataclass(frozen=True)
class Usage:
    turns: int
    forks: int
    bytes: int


def check_session(found: Usage, settings: Settings) -> None:
    """GatewayError 409 when the session has reached a cap."""
    for value, cap, what, flag in ((found.turns, settings.max_session_turns, "turns", "--max-session-turns"),
                                   (found.forks, settings.max_session_forks, "forks", "--max-session-forks"),
                                   (found.bytes, settings.max_session_mb * 1024 * 1024, "bytes stored",
                                    "--max-session-mb")):
        if value >= cap:
            setting = settings_value(flag, settings)
            raise GatewayError(409, f"the session has {value} {what}, the cap ({flag} {setting}); finish it and "
                                    "start a new session")


def settings_value(flag: str, settings: Settings) -> object:
    return getattr(settings, flag.removeprefix("--").replace("-", "_"))


async def check_open_sessions(gw: Gateway, run_id: str) -> GatewayError | None:
    """A 429 (with Retry-After) when the run, or the server, has as many open sessions as it may."""
    settings = gw.settings
    runs = await retention.running_runs(gw.store)
    pipe = gw.store.redis.pipeline(transaction=False)
    for other in runs:
        pipe.zcard(keys.session_open(other))
    counts = dict(zip(runs, await pipe.execute()))
    in_run, in_server = int(counts.get(run_id, 0)), sum(int(c) for c in counts.values())
    if in_run >= settings.max_open_sessions_per_run:
        return GatewayError(429, f"the run has {in_run} open sessions, the cap (--max-open-sessions-per-run "
                                 f"{settings.max_open_sessions_per_run}); retry once some have finished")
    if in_server >= settings.max_open_sessions:
        return GatewayError(429, f"the server has {in_server} open sessions, the cap (--max-open-sessions "
                                 f"{settings.max_open_sessions}); retry once some have finished")
    return None
