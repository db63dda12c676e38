"""`/get_rollout_data`: take ready groups, run the task's group hooks, build `meta_info`.

Hooks run at hand-over time, in the reading process. A filtered group's instance id is still reported in
`finished_groups` (and its group key in `finished_group_keys`): it was consumed, and a resumed run must
not roll it out again. For a leased batch the filter counts are stored with the lease and counted when it
is acknowledged, so a batch read twice (a retry, or again after its lease ran out) is counted once; a
retry re-runs the hooks on the same records, so hooks must be deterministic (slime's are).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_buffer import handover
from rollout_buffer.handover import ReadBatch
from rollout_buffer.metrics.readlog import record_read
from rollout_buffer.store import Store
from rollout_buffer.tasks import TaskModule

log = logging.getLogger(__name__)


def _apply_hooks(batch: ReadBatch, task: TaskModule | None, task_type: str, min_valid_group_size: int,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, list[dict[str, Any]]]]:
    records: list[dict[str, Any]] = []
    finished: list[str] = []
    finished_keys: list[str] = []
    filtered: list[str] = []
    hook_errors: list[str] = []
    failed: list[str] = []  # groups whose members all failed: the trainer side stops on a run of them
    temp_data: dict[str, list[dict[str, Any]]] = {}
    for group in batch.groups:
        items = group.records
        for item in items:
            item["epoch"] = group.epoch
        finished.append(group.instance_id)
        finished_keys.append(group.gid)
        if items and all(item.get("status") == "failed" for item in items):
            failed.append(group.instance_id)
        temp_data.setdefault(group.instance_id, []).extend(items)
        if task is None:
            records.extend(items)
            continue
        try:
            valid = task.is_valid_group((group.instance_id, items), min_valid_group_size, task_type)
            if valid:
                _, items = task.transform_group((group.instance_id, items), task_type)
        except Exception:  # a buggy hook filters its group, visibly, instead of failing the read
            log.exception("group hook of task %s failed on instance %s", task_type, group.instance_id)
            hook_errors.append(group.instance_id)
            valid = False
        if valid:
            records.extend(items)
        else:
            filtered.append(group.instance_id)
    info = {"finished_groups": finished, "finished_group_keys": finished_keys, "filtered_groups": filtered,
            "hook_error_groups": hook_errors, "failed_groups": failed}
    return records, info, temp_data


def _meta_info(batch: ReadBatch, info: dict[str, Any], records: list[dict[str, Any]],
               stats: dict[str, float]) -> dict[str, Any]:
    since = batch.since
    total = int(since.get("total_samples", 0))
    num_groups = batch.num_since_groups
    meta: dict[str, Any] = {
        "total_samples": total,
        "num_groups": num_groups,
        "avg_group_size": total / num_groups if num_groups else 0.0,
        "avg_reward": float(since.get("reward_sum", 0.0)) / total if total else 0.0,
        "status_counts": {k.split(":", 1)[1]: int(v) for k, v in since.items() if k.startswith("status:")},
        "returned_samples": len(records),
        "returned_groups": len(info["finished_groups"]) - len(info["filtered_groups"]),
        "num_filtered_groups": len(info["filtered_groups"]),
        "timed_out_groups": batch.timed_out_groups,
        "drops": {k.split(":", 1)[1]: int(v) for k, v in stats.items() if k.startswith("drop:")},
        **info,
    }
    if batch.kind in ("leased", "retry"):
        meta["batch_id"] = batch.batch_id
        meta["lease_s"] = batch.lease_s
        meta["retry"] = batch.kind == "retry"
    return meta


async def read_rollout_data(store: Store, run_id: str, task: TaskModule | None, *, num: int | None,
                            wait_s: float, min_valid_group_size: int, lease_s: float = 0.0,
                            batch_id: str = "") -> dict[str, Any]:
    """The `/get_rollout_data` answer for `run_id` (see DESIGN.md's wire contract). With `lease_s` the
    groups are leased under `batch_id` until acknowledged (`handover.ack_batch`)."""
    deadline = time.monotonic() + wait_s
    while True:
        batch = await handover.read_ready(store, run_id, num, lease_s=lease_s, batch_id=batch_id)
        if batch.kind == "acked":
            return empty(f"batch {batch_id} was already acknowledged; read with a new batch_id for more data",
                         {"batch_id": batch_id, "acknowledged": True})
        if batch.groups:
            break
        head = await handover.head_group_size(store, run_id)
        if head is not None and num is not None and head > num:
            return empty(f"num={num} is smaller than the next ready group ({head} records); "
                         "ask for at least one whole group")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return empty("no group is ready")
        await handover.wait_for_ready(store, run_id, remaining)
    task_type = task.task_type if task else ""
    records, info, temp_data = await asyncio.to_thread(_apply_hooks, batch, task, task_type, min_valid_group_size)
    filtered, hook_errors = len(info["filtered_groups"]), len(info["hook_error_groups"])
    if batch.kind == "leased":
        await handover.set_lease_outcome(store, run_id, batch_id, filtered=filtered, hook_errors=hook_errors)
    elif batch.kind == "handed":
        await store.incr_stats(run_id, {"groups_filtered": filtered, "drop:filtered_group": filtered,
                                        "drop:hook_error": hook_errors})
    meta = _meta_info(batch, info, records, await store.stats(run_id))
    meta["run_id"] = run_id
    if task is not None and task.get_group_data_meta_info is not None:
        try:
            meta.update(task.get_group_data_meta_info(temp_data))
        except Exception:
            log.exception("get_group_data_meta_info of task %s failed", task_type)
    try:  # the groups are taken already: the dashboard's log must never cost the trainer its answer
        await record_read(store, run_id, batch, records, meta)
    except Exception:
        log.exception("could not log the read of run %s for the dashboard", run_id)
    return {
        "success": bool(records) or bool(info["finished_groups"]),
        "message": f"{len(info['finished_groups'])} group(s), {len(records)} sample(s)"
                   + (f" (batch {batch_id}, leased for {batch.lease_s:g} s)" if batch_id else ""),
        "data": {"data": records, "meta_info": meta},
    }


def empty(message: str, meta_info: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"success": False, "message": message, "data": {"data": [], "meta_info": meta_info or {}}}
