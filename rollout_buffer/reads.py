"""`/get_rollout_data`: pop ready groups, run the task's group hooks, build `meta_info`.

Hooks run at hand-over time, in the reading process, so a group is filtered or transformed exactly once
(the pop is atomic). A filtered group's instance id is still reported in `finished_groups`: it was
consumed, and a resumed run must not roll it out again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_buffer.store import ReadBatch, Store
from rollout_buffer.tasks import TaskModule

log = logging.getLogger(__name__)


def _apply_hooks(batch: ReadBatch, task: TaskModule | None, task_type: str, min_valid_group_size: int,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, list[dict[str, Any]]]]:
    records: list[dict[str, Any]] = []
    finished: list[str] = []
    filtered: list[str] = []
    hook_errors: list[str] = []
    failed: list[str] = []  # groups whose members all failed: the trainer side stops on a run of them
    temp_data: dict[str, list[dict[str, Any]]] = {}
    for group in batch.groups:
        items = group.records
        for item in items:
            item["epoch"] = group.epoch
        finished.append(group.instance_id)
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
    info = {"finished_groups": finished, "filtered_groups": filtered, "hook_error_groups": hook_errors,
            "failed_groups": failed}
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
    return meta


async def read_rollout_data(store: Store, run_id: str, task: TaskModule | None, *, num: int | None,
                            wait_s: float, min_valid_group_size: int) -> dict[str, Any]:
    """The `/get_rollout_data` answer for `run_id` (see DESIGN.md's wire contract)."""
    deadline = time.monotonic() + wait_s
    while True:
        batch = await store.read_ready(run_id, num)
        if batch.groups:
            break
        head = await store.head_group_size(run_id)
        if head is not None and num is not None and head > num:
            return _empty(f"num={num} is smaller than the next ready group ({head} records); "
                          "ask for at least one whole group")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _empty("no group is ready")
        await store.wait_for_ready(run_id, remaining)
    task_type = task.task_type if task else ""
    records, info, temp_data = await asyncio.to_thread(_apply_hooks, batch, task, task_type, min_valid_group_size)
    if info["filtered_groups"]:
        await store.incr_stat(run_id, "groups_filtered", len(info["filtered_groups"]))
        await store.incr_stat(run_id, "drop:filtered_group", len(info["filtered_groups"]))
    if info["hook_error_groups"]:
        await store.incr_stat(run_id, "drop:hook_error", len(info["hook_error_groups"]))
    meta = _meta_info(batch, info, records, await store.stats(run_id))
    meta["run_id"] = run_id
    if task is not None and task.get_group_data_meta_info is not None:
        try:
            meta.update(task.get_group_data_meta_info(temp_data))
        except Exception:
            log.exception("get_group_data_meta_info of task %s failed", task_type)
    return {
        "success": bool(records) or bool(info["finished_groups"]),
        "message": f"{len(info['finished_groups'])} group(s), {len(records)} sample(s)",
        "data": {"data": records, "meta_info": meta},
    }


def _empty(message: str) -> dict[str, Any]:
    return {"success": False, "message": message, "data": {"data": [], "meta_info": {}}}
