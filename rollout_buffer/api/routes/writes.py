"""Write routes: one record, a JSON batch, a packed binary batch (all idempotent by uid)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from rollout_buffer.api.bodies import json_body, parse_body_with
from rollout_buffer.api.errors import error_response
from rollout_buffer.api.responses import OrjsonResponse
from rollout_buffer.api.state import AppState, state_of
from rollout_buffer.store.store import WriteOutcome
from rollout_buffer.wire.packed_batch import CONTENT_TYPE, PackedBatchError, decode_batch, stamped_blob
from rollout_buffer.wire.record_parsing import ParsedRecord, parse_batch, parse_record
from rollout_buffer.wire.schema import BatchWriteRequest, TrajectoryRecord

router = APIRouter()


def batch_answer(state: AppState, run_id: str, uids: list[str], outcomes: list[WriteOutcome]) -> dict[str, Any]:
    """The answer of the batch write routes: one result per record, in order, and counts."""
    results = []
    for uid, outcome in zip(uids, outcomes):
        results.append({"uid": uid, "outcome": outcome.outcome, "reason": outcome.reason,
                        "group_completed": outcome.outcome == "completed"})
    counts = {name: sum(1 for o in outcomes if o.outcome == name) for name in ("stored", "completed", "duplicate", "dropped")}
    return {"success": counts["dropped"] == 0, "run_id": run_id,
            "message": f"{counts['stored'] + counts['completed']} stored, {counts['duplicate']} duplicate(s), "
                       f"{counts['dropped']} dropped",
            "data": {"results": results, **counts}}


def stamped(parsed: ParsedRecord) -> ParsedRecord:
    """A record written without a `timestamp` gets the time the buffer stored it: slime's buffer client sorts
    the groups it reads by it (and `float()`s it), and the hand-over delay is measured from it."""
    if parsed.record.timestamp is None:
        parsed.record.timestamp = time.time()
    return parsed


async def superseded_answer(state: AppState, run_id: str) -> Any:
    """409 naming the successor of a superseded run (its data is rolled out again there)."""
    status, body = await _superseded(state, run_id)
    return OrjsonResponse(body, status_code=status)


async def _superseded(state: AppState, run_id: str) -> tuple[int, dict[str, Any]]:
    meta = await state.store.run_meta(run_id)
    successor = meta.get("superseded_by", "")
    return _refusal(409, f"run {run_id!r} was superseded by {successor!r} "
                         f"({meta.get('superseded_reason', 'a new generation')}); use that run",
                    superseded_by=successor)


async def missing_run_answer(state: AppState, run_id: str) -> Any:
    """A run that is not in the index: 409 naming the successor when it is a superseded run's tombstone
    (`rollout_buffer.runs.retention`), else 404."""
    if (await state.store.run_meta(run_id)).get("superseded_by"):
        return await superseded_answer(state, run_id)
    return error_response(404, f"unknown run_id {run_id!r}")


async def write_one(state: AppState, parsed: ParsedRecord, pinned_run_id: str | None) -> tuple[int, dict[str, Any]]:
    """One `/buffer/write` of a parsed record: `(status, answer)`. Shared by the routes below and the lean
    ASGI path (`rollout_buffer.api.fast_write`), which serves the same URLs without the framework's
    per-request work."""
    record = parsed.record
    if pinned_run_id is not None and record.run_id not in (None, pinned_run_id):
        return _refusal(422, f"record names run {record.run_id!r}, the URL names run {pinned_run_id!r}")
    run_id = pinned_run_id or record.run_id or await state.store.active_run()
    if run_id is None:
        return _refusal(409, "no active run: start one with POST /start_rollout (or give the record a run_id)")
    outcome = await state.store.write_record(run_id, stamped(parsed).to_store())
    if outcome.reason == "unknown_run":  # checked inside the write script: no extra round trip
        return _refusal(404, f"unknown run_id {run_id!r}")
    if outcome.reason == "run_superseded":
        return await _superseded(state, run_id)
    data = {"uid": record.uid, "run_id": run_id, "outcome": outcome.outcome}
    if outcome.outcome == "dropped":
        if outcome.reason == "skipped_group":
            return 200, {"success": False, "message": f"the group of instance {record.instance_id} was trained "
                                                      "already (skipped in this run); not stored (counted)",
                         "data": data}
        return _refusal(409, f"record {record.uid} not stored: {outcome.reason.replace('_', ' ')} "
                             f"(group of instance {record.instance_id} is closed or full)")
    message = "already stored (duplicate uid)" if outcome.outcome == "duplicate" else "stored"
    return 200, {"success": True, "message": message,
                 "data": {**data, "group_completed": outcome.outcome == "completed"}}


def _refusal(status: int, message: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    """The body `error_response` would send (`{"success": false, "message": ...}`)."""
    return status, {"success": False, "message": message, **extra}


async def _write_one(request: Request, pinned_run_id: str | None) -> Any:
    parsed = await parse_body_with(request, parse_record)
    status, answer = await write_one(state_of(request), parsed, pinned_run_id)
    return answer if status == 200 else OrjsonResponse(answer, status_code=status)


@router.post("/buffer/write", openapi_extra=json_body(TrajectoryRecord))
async def buffer_write(request: Request) -> Any:
    """Store one trajectory; idempotent by uid for the run's life. Attaches to the active run unless
    `run_id` is given."""
    return await _write_one(request, None)


@router.post("/runs/{run_id}/buffer/write", openapi_extra=json_body(TrajectoryRecord))
async def run_buffer_write(run_id: str, request: Request) -> Any:
    """`/buffer/write` into the run the URL names (the URL slime-style task modules are given, so a
    retired run's late writes are refused and counted instead of landing in the active run)."""
    return await _write_one(request, run_id)


@router.post("/buffer/write_batch", openapi_extra=json_body(BatchWriteRequest))
async def buffer_write_batch(request: Request) -> Any:
    """Store many trajectories in one request and one Redis round trip; same rules as /buffer/write.
    The whole batch is validated first: one bad record refuses the batch and stores nothing."""
    batch_run_id, parsed = await parse_body_with(request, parse_batch)
    state = state_of(request)
    run_id = batch_run_id or await state.store.active_run()
    if run_id is None:
        return error_response(409, "no active run: start one with POST /start_rollout (or give run_id)")
    if not await state.store.run_exists(run_id):
        return await missing_run_answer(state, run_id)
    foreign = [p.record.uid for p in parsed if p.record.run_id not in (None, run_id)]
    if foreign:
        return error_response(422, f"records {foreign[:5]} name another run than {run_id!r}")
    outcomes = await state.store.write_records(run_id, [stamped(p).to_store() for p in parsed])
    return batch_answer(state, run_id, [p.record.uid for p in parsed], outcomes)


@router.post("/buffer/write_packed", openapi_extra={"requestBody": {"required": True, "content": {
    CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
async def buffer_write_packed(request: Request, run_id: str | None = None) -> Any:
    """Store many records sent in the store's packed binary form (see `rollout_buffer.wire.packed_batch`):
    the fastest ingest path, no JSON token lists. All-or-nothing validation, like /buffer/write_batch."""
    try:
        items = decode_batch(await request.body())
    except PackedBatchError as exc:
        return error_response(422, f"invalid packed batch: {exc}")
    state = state_of(request)
    run_id = run_id or items[0].fields.get("run_id") or await state.store.active_run()
    if run_id is None:
        return error_response(409, "no active run: start one with POST /start_rollout (or give ?run_id=)")
    foreign = [i.fields["uid"] for i in items if i.fields.get("run_id") not in (None, run_id)]
    if foreign:
        return error_response(422, f"records {foreign[:5]} name another run than {run_id!r}")
    if not await state.store.run_exists(run_id):
        return await missing_run_answer(state, run_id)
    outcomes = await state.store.write_records(run_id, [i.fields for i in items],
                                               blobs=[stamped_blob(i, run_id) for i in items])
    return batch_answer(state, run_id, [i.fields["uid"] for i in items], outcomes)
