"""Operational routes: health, discovered task modules, Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollout_buffer import __version__
from rollout_buffer.app_state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Any:
    state = state_of(request)
    await state.store.redis.ping()
    return {"status": "ok", "version": __version__, "embedded_redis": state.embedded is not None}


@router.get("/tasks")
async def tasks(request: Request) -> Any:
    """Discovered task modules, and the modules that failed to load with their errors."""
    return state_of(request).registry.describe()


@router.get("/metrics")
async def metrics(request: Request) -> Any:
    """Prometheus text: this process's counters, and the active run's totals from Redis (drops by
    reason, groups, records) as `rollout_buffer_run{run_id, stat}`."""
    state = state_of(request)
    run_id = await state.store.active_run()
    if run_id:
        for name, value in (await state.store.stats(run_id)).items():
            state.run_stats.labels(run_id, name).set(value)
    return PlainTextResponse(generate_latest(state.metrics), media_type=CONTENT_TYPE_LATEST)
