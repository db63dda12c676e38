"""Never poll forever on a run that cannot deliver: `RunFailedError` names the run, its failures and why.

Two signals, both from the buffer:

* a read's `meta_info.failed_groups` (groups whose members all failed, in `finished_groups` order): when
  `max_failed_groups` (`agent_max_consecutive_failed_groups`) groups in a row failed entirely, the run is
  failing systematically (a dead engine, a task that cannot read the data) and waiting cannot fix it;
* `GET /runs/{run_id}` after a read that got nothing: a native run whose tasks have all ended (status
  `finished`) or whose task module failed (status `failed`), with no group ready, has nothing left to
  hand over; nor has a run the buffer no longer knows (404, or status `deleted`). A legacy run that
  `finished` is not judged: its records may come from outside writers.

The error carries the failure counts by type and the first error message (`GET /runs/{id}` `failures`).
`fetch_trajectory_retry_times` keeps its own, separate meaning: consecutive fetches that got nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from slime_adapter.auth import auth_headers

__all__ = ["RunFailedError", "RunHealth", "describe_run", "exhausted_reason", "get_run_detail"]

log = logging.getLogger(__name__)
DETAIL_TIMEOUT_S = 10.0


class RunFailedError(RuntimeError):
    """The buffer's run cannot (or can no longer) deliver what the trainer waits for."""

    def __init__(self, message: str, run_id: str | None, detail: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.detail = detail or {}


async def get_run_detail(buffer_url: str, run_id: str, timeout_s: float = DETAIL_TIMEOUT_S) -> dict[str, Any] | None:
    """`GET /runs/{run_id}`; `{"missing": True}` when the buffer does not know the run (404), None when it
    cannot say (unreachable, another error status, not JSON)."""
    url = f"{buffer_url.rstrip('/')}/runs/{run_id}"
    try:
        async with (asyncio.timeout(timeout_s), aiohttp.ClientSession() as session,
                    session.get(url, headers=auth_headers(url)) as response):
            if response.status == 404:
                return {"missing": True}
            if response.status != 200:
                return None
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("GET %s failed: %s", url, exc)
        return None
    return body if isinstance(body, dict) else None


def describe_run(detail: dict[str, Any]) -> str:
    """One sentence of a run's task counts, failures by type and first error, for error messages."""
    if detail.get("missing"):
        return "the buffer has no record of it"
    tasks = detail.get("tasks") or {}
    parts = [f"tasks: {tasks.get('done', 0)} done, {tasks.get('failed', 0)} failed, "
             f"{tasks.get('running', 0)} running, {tasks.get('queued', 0)} queued"]
    failures = detail.get("failures") or {}
    by_type = failures.get("by_type") or {}
    if by_type:
        parts.append("failures: " + ", ".join(f"{name} x{info.get('count', 0)}" for name, info in by_type.items()))
    first = failures.get("first_error")
    if first:
        parts.append(f"first error ({first.get('type')}, {first.get('uid')}): {first.get('message')}")
    return "; ".join(parts)


def exhausted_reason(detail: dict[str, Any]) -> str | None:
    """Why the run can hand over nothing more, or None while it still may (see the module docstring)."""
    if detail.get("missing"):
        return "the buffer does not know the run (deleted, or its data was lost)"
    meta = detail.get("meta") or {}
    groups = detail.get("groups") or {}
    if int(groups.get("ready", 0) or 0) > 0:
        return None
    status = meta.get("status")
    if status == "deleted":
        return "the run was deleted"
    if status == "failed":
        return "its task module failed (run status 'failed') and no group is ready"
    if status == "finished" and meta.get("enqueue_done") == "1":
        return "every rollout task has ended (run status 'finished') and no group is ready"
    return None


@dataclass
class RunHealth:
    """Consecutive all-failed groups of the run this trainer reads, across steps."""

    streak: int = 0

    def observe(self, meta: dict[str, Any]) -> None:
        """Follow one read's groups in hand-over order: an all-failed group extends the streak, any other ends it."""
        failed = Counter(str(i) for i in meta.get("failed_groups") or [])
        for instance_id in meta.get("finished_groups") or []:
            if failed[str(instance_id)] > 0:
                failed[str(instance_id)] -= 1
                self.streak += 1
            else:
                self.streak = 0

    async def check(self, buffer_url: str, run_id: str | None, limit: int, where: str) -> None:
        """Raise `RunFailedError` once `limit` (> 0) groups in a row failed entirely."""
        if limit <= 0 or self.streak < limit:
            return
        detail = await get_run_detail(buffer_url, run_id) if run_id else None
        raise RunFailedError(
            f"{where}: the last {self.streak} group(s) of run {run_id} failed entirely (every rollout of each "
            f"failed; the limit is agent_max_consecutive_failed_groups={limit}); "
            f"{describe_run(detail) if detail else 'the buffer did not describe the run'}. "
            f"See GET {buffer_url}/runs/{run_id}.", run_id, detail)


async def raise_if_exhausted(buffer_url: str, run_id: str | None, where: str) -> None:
    """After a read that got nothing: raise `RunFailedError` when the run can hand over nothing more."""
    if not run_id:
        return
    detail = await get_run_detail(buffer_url, run_id)
    reason = exhausted_reason(detail) if detail else None
    if reason is None or detail is None:
        return
    raise RunFailedError(
        f"{where}: run {run_id} can hand over nothing more: {reason}; {describe_run(detail)}. If its rollouts "
        f"succeeded, the data is used up (raise --num-epoch, or lower --num-rollout); see GET "
        f"{buffer_url}/runs/{run_id}.", run_id, detail)
