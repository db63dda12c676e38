"""Runs go away: `DELETE /runs/{id}`, and the retention policy (`--retain-runs`, `--run-ttl-s`).

Deleting a run first marks it `deleted` (its workers stop at their next step, its tasks are acknowledged
without running, its late writes are refused), then unlinks every key of `keys.run_keys`: no script
re-creates a run's keys once its meta is gone. Retention only ever deletes *retired* runs: superseded or
failed ones, and finished ones with nothing left for a reader (no incomplete, ready or leased group).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rollout_buffer.store import handover, keys
from rollout_buffer.store.store import Store, text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunAge:
    run_id: str
    created_at: float
    ended_at: float | None  # when it became retired; None while it is not


async def delete_run(store: Store, run_id: str) -> bool:
    """Remove every key of the run; False when no such run exists."""
    if not await store.run_exists(run_id):
        return False
    await store.redis.hset(keys.run_meta(run_id), mapping={"status": "deleted", "deleted_at": time.time()})
    await store.redis.unlink(*keys.run_keys(run_id))
    await store.redis.hdel(keys.RUNS, run_id)
    if await store.active_run() == run_id:
        await store.redis.delete(keys.ACTIVE_RUN)
    log.info("run %s deleted", run_id)
    return True


async def run_age(store: Store, run_id: str) -> RunAge:
    """When the run was created, and when (if) it became retired."""
    meta = await store.run_meta(run_id)
    created = float(meta.get("created_at") or 0.0)
    status = meta.get("status", "")
    ended: float | None = None
    if status in ("superseded", "failed", "deleted"):
        ended = float(meta.get(f"{status}_at") or created)
    elif status == "finished":
        counts = await handover.group_counts(store, run_id)
        if counts["pending"] == counts["ready"] == counts["leased"] == 0:
            ended = float(meta.get("finished_at") or created)
    return RunAge(run_id, created, ended)


async def apply_retention(store: Store, *, retain_runs: int | None, run_ttl_s: float | None,
                          now: float | None = None) -> list[str]:
    """Delete retired runs older than `run_ttl_s`, and retired runs beyond the `retain_runs` newest runs;
    returns the ids deleted."""
    if retain_runs is None and run_ttl_s is None:
        return []
    now = time.time() if now is None else now
    ages = sorted([await run_age(store, r) for r in await store.list_runs()], key=lambda a: a.created_at,
                  reverse=True)
    doomed: list[str] = []
    for rank, age in enumerate(ages):
        if age.ended_at is None:
            continue
        too_many = retain_runs is not None and rank >= retain_runs
        too_old = run_ttl_s is not None and now - age.ended_at >= run_ttl_s
        if too_many or too_old:
            doomed.append(age.run_id)
    for run_id in doomed:
        await delete_run(store, run_id)
    return doomed


async def running_runs(store: Store) -> list[str]:
    """Runs still generating or holding groups for readers (not superseded, failed or deleted)."""
    run_ids = await store.list_runs()
    if not run_ids:
        return []
    async with store.redis.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hget(keys.run_meta(run_id), "status")
        statuses = await pipe.execute()
    return [r for r, s in zip(run_ids, statuses) if text(s) in ("running", "finished")]
