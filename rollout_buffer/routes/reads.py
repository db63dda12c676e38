"""The read route: hand ready groups to the trainer (slime's `/get_rollout_data`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.app_state import state_of
from rollout_buffer.http_errors import error_response
from rollout_buffer.reads import read_rollout_data
from rollout_buffer.schema import GetRolloutDataRequest

router = APIRouter()


@router.post("/get_rollout_data")
async def get_rollout_data(request: Request, body: GetRolloutDataRequest | None = None) -> Any:
    """Hand over ready groups, whole and in completion order; `num` caps the sample count."""
    state = state_of(request)
    body = body or GetRolloutDataRequest()
    run_id = body.run_id or await state.store.active_run()
    if run_id is None:
        return {"success": False, "message": "no active run", "data": {"data": [], "meta_info": {}}}
    meta = await state.store.run_meta(run_id)
    if not meta:
        return error_response(404, f"unknown run_id {run_id!r}")
    task = state.registry.get(meta.get("task_type", ""))
    config = await state.store.run_config(run_id) or {}
    # Groups reach a reader complete, or incomplete only by the group-timeout hand_over policy, which
    # must not be undone by the default size check; `min_valid_group_size` in /start_rollout raises it.
    min_valid = int(config.get("min_valid_group_size") or 1)
    answer = await read_rollout_data(state.store, run_id, task, num=body.num, wait_s=body.wait_s,
                                     min_valid_group_size=min_valid)
    state.reads.labels("data" if answer["success"] else "empty").inc()
    return answer
