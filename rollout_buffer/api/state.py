"""What every route handler of one API process shares (`app.state.buffer`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from prometheus_client import CollectorRegistry

from rollout_buffer.runs.lifecycle import Runtime
from rollout_buffer.settings import Settings
from rollout_buffer.store.embedded import EmbeddedRedis
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.discovery import TaskRegistry


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: TaskRegistry
    runtime: Runtime
    embedded: EmbeddedRedis | None
    # this process's own collectors (remote rollouts' mask counters); /metrics adds them to the run metrics
    # it reads from Redis
    metrics: CollectorRegistry


def state_of(request: Request) -> AppState:
    return request.app.state.buffer
