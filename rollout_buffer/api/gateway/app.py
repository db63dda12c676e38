"""The gateway's part of the app: its routers and its per-process state and background sweep."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from rollout_buffer.api.gateway import routes_anthropic, routes_openai, routes_responses, routes_sessions
from rollout_buffer.api.gateway.context import Gateway
from rollout_buffer.api.gateway.reaper import reap_forever
from rollout_buffer.settings import Settings
from rollout_buffer.store.store import Store

ROUTERS = (routes_sessions.router, routes_openai.router, routes_anthropic.router, routes_responses.router)


def include_routers(app: FastAPI) -> None:
    for router in ROUTERS:
        app.include_router(router)


def start(app: FastAPI, store: Store, settings: Settings) -> asyncio.Task[None]:
    """Set up `app.state.gateway`; returns the idle-session sweep (the caller cancels it at shutdown)."""
    app.state.gateway = Gateway(store, settings)
    return asyncio.create_task(reap_forever(app.state.gateway), name="gateway-session-reaper")


async def stop(app: FastAPI) -> None:
    gateway = getattr(app.state, "gateway", None)
    if gateway is not None:
        await gateway.close()
