"""Runs go away: `DELETE /runs/{id}`, and the retention policy (`--retain-runs`, `--run-ttl-s`).

Deleting a run unlinks every key of `keys.run_keys` in one script: its workers stop at their next step,
its tasks are acknowledged without running, its late writes are refused, and no script re-creates a run's
keys once its meta is gone. Retention only ever deletes *retired* runs: superseded or failed ones, and
finished ones with nothing left for a reader (no incomplete, ready or leased group).

A superseded run is one link of a chain `<id>` -> `<id>.r1` -> ...: `/start_rollout` follows it to the
newest generation, and that generation alone knows what was handed over. So deleting a superseded run keeps
a tombstone: its meta with only `status: deleted`, `superseded_by` and when and why. The chain still leads
to the live generation (a start of `<id>` resumes it instead of creating `<id>` afresh and handing its
groups over again), reads and writes of the deleted id answer 409 naming the successor, and every script
treats the run as gone. A tombstone is a few fields; it is not in the run index, so no listing or
retention pass sees it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rollout_buffer import handover, keys
from rollout_buffer.store import Store, text

# KEYS: every key of the run, its meta first. ARGV: 1 now. Unlinks them all; a superseded run's meta comes
# back as its tombstone. Returns 1 when a tombstone was kept.
DELETE_RUN = """
local link = redis.call('HMGET', KEYS[1], 'superseded_by', 'superseded_reason', 'superseded_at', 'created_at')
redis.call('UNLINK', unpack(KEYS))
if not link[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'deleted', 'deleted_at', ARGV[1], 'superseded_by', link[1],
           'superseded_reason', link[2] or '', 'superseded_at', link[3] or '', 'created_at', link[4] or '')
return 1
"""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunAge:
    run_id: str
    created_at: float
    ended_at: float | None  # when it became retired; None while it is not


async def delete_run(store: Store, run_id: str) -> bool:
    """Remove every key of the run (a superseded one leaves its tombstone); False when no such run exists."""
    if not await store.run_exists(run_id):
        return False
    tombstone = await store.redis.register_script(DELETE_RUN)(keys=keys.run_keys(run_id), args=[time.time()])
    await store.redis.hdel(keys.RUNS, run_id)
    if await store.active_run() == run_id:
        await store.redis.delete(keys.ACTIVE_RUN)
    log.info("run %s deleted%s", run_id, " (its tombstone keeps the link to its successor)" if int(tombstone) else "")
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
