"""HTTP routes of the remote-rollout protocol: `POST /init` and `GET /init/{rollout_id}`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.errors import error_response
from rollout_buffer.api.responses import OrjsonResponse
from rollout_buffer.remote.schema import InitRequest
from rollout_buffer.remote.service import RemoteService

router = APIRouter()


def _service(request: Request) -> RemoteService:
    return request.app.state.remote


@router.post("/init", status_code=202)
async def init(body: InitRequest, request: Request) -> Any:
    """Start one remote rollout in the background: 202 when new; 200 with the existing state when the
    rollout_id is already known (nothing new starts)."""
    service = _service(request)
    problem = service.task_problem(body.task_type)
    if problem is not None:
        return error_response(422, problem, [{"field": "task_type", "message": problem}])
    denied = service.refusal(body)
    if denied is not None:
        message = f"{denied.field}: {denied}"
        return error_response(denied.status_code, message, [{"field": denied.field, "message": message}])
    created, state = await service.init(body)
    message = "rollout accepted" if created else "rollout_id already known; nothing started"
    return OrjsonResponse({"success": True, "message": message, "created": created, **state},
                          status_code=202 if created else 200)


@router.get("/init/{rollout_id}")
async def init_state(rollout_id: str, request: Request) -> Any:
    """State of one remote rollout: queued | running | completed | error, callback delivery, counts."""
    state = await _service(request).view(rollout_id)
    if state is None:
        return error_response(404, f"unknown rollout_id {rollout_id!r}")
    return state
