"""`POST /policy_version`: the trainer's policy version, for trainers that do not send it with their reads.

The version becomes the run's: engine calls starting from now are stamped with it (unless the engine
reports a numeric `weight_version` of its own), and reads measure staleness against it. With
`abort_in_flight` every engine of the run's `remote_engine_url` (one, or each of a list) aborts every
generation in flight (SGLang's `/abort_request` with `abort_all`), and the answer reports each engine
(`data.engines`); the workers continue each generation under the new version, so one turn's tokens carry
two versions (`turns[].version_spans`) and a trainer can mask the off-policy part. The engines are checked
against `--allow-url` before anything changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.errors import error_response
from rollout_buffer.api.routes.writes import superseded_answer
from rollout_buffer.api.state import state_of
from rollout_buffer.runtime.engine_http import abort_all_requests
from rollout_buffer.security.access import AccessDenied
from rollout_buffer.security.outbound import abort_targets
from rollout_buffer.tasks.contract import EngineError
from rollout_buffer.wire.schema import PolicyVersionRequest

router = APIRouter()


@router.post("/policy_version")
async def policy_version(body: PolicyVersionRequest, request: Request) -> Any:
    """Set the run's policy version (the active run unless `run_id` is given); `abort_in_flight` aborts the
    in-flight generations of every engine of the run, which continue under the new version."""
    state = state_of(request)
    run_id = body.run_id or await state.store.active_run()
    if run_id is None:
        return error_response(409, "no active run: give run_id")
    meta = await state.store.run_meta(run_id)
    if meta.get("status") == "superseded":
        return await superseded_answer(state, run_id)
    config = await state.store.run_config(run_id) or {}
    targets: tuple[str, ...] = ()
    if body.abort_in_flight:
        try:
            targets = abort_targets(request.app.state.access, str(config.get("remote_engine_url") or ""))
        except AccessDenied as exc:
            message = f"abort_in_flight: {exc}"
            return error_response(exc.status_code, message, [{"field": exc.field, "message": message}])
        if not targets:
            return error_response(422, f"abort_in_flight: run {run_id!r} has no remote_engine_url to abort at")
    live, previous = await state.store.set_policy_version(run_id, body.version)
    if not live:
        return error_response(404, f"unknown run_id {run_id!r}")
    data: dict[str, Any] = {"run_id": run_id, "policy_version": body.version, "previous": previous,
                            "aborted": False}
    if body.abort_in_flight:
        data["engines"] = await _abort_each(targets)
        failed = [e for e in data["engines"] if not e["aborted"]]
        if failed:
            causes = "; ".join(e["error"] for e in failed)
            return error_response(502, f"policy version of run {run_id!r} set to {body.version}, but aborting the "
                                       f"generations in flight failed at {len(failed)} of {len(targets)} "
                                       f"engine(s): {causes}", extra={"data": data})
        data["aborted"] = True
    return {"success": True, "message": f"run {run_id} is at policy version {body.version}"
                                        + (" (in-flight generations aborted)" if data["aborted"] else ""),
            "data": data}


async def _abort_each(targets: tuple[str, ...]) -> list[dict[str, Any]]:
    """Abort at every target at once; one entry per target: `{url, aborted}` plus `error` when it failed."""
    results = await asyncio.gather(*(abort_all_requests(target) for target in targets), return_exceptions=True)
    report: list[dict[str, Any]] = []
    for target, result in zip(targets, results, strict=True):
        if isinstance(result, EngineError):
            report.append({"url": target, "aborted": False, "error": str(result)})
        elif isinstance(result, BaseException):
            raise result
        else:
            report.append({"url": target, "aborted": True})
    return report
