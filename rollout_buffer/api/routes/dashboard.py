"""The live dashboard: `GET /` (one static page), its data `GET /api/dashboard`, its files under
`/static/dashboard` (the page's script and style, and the vendored uPlot chart library: no build step, no
CDN, so it renders on a cluster node without internet).

The page polls `/api/dashboard` and redraws itself; `rollout-buffer status` shows the same JSON in a
terminal. All URLs in the page are relative, so it also works behind a proxy that serves the buffer
under a path prefix.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from rollout_buffer.api.errors import error_response
from rollout_buffer.api.state import state_of
from rollout_buffer.metrics.dashboard import DEFAULT_READS, UnknownRun, dashboard_data

STATIC_URL = "/static/dashboard"


def static_dir() -> Path:
    """The page's files inside the installed package."""
    return Path(str(resources.files("rollout_buffer"))) / "static" / "dashboard"


def install_dashboard(app: FastAPI) -> None:
    """Mount the page's files and add `/` and `/api/dashboard` to `app`."""
    folder = static_dir()
    page = (folder / "index.html").read_text(encoding="utf-8")
    app.mount(STATIC_URL, StaticFiles(directory=folder), name="dashboard-static")
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/api/dashboard")
    async def dashboard(request: Request, run_id: str | None = None,
                        reads: int = Query(DEFAULT_READS, ge=0, le=1000)) -> Any:
        """Every live run's progress (tasks, groups, epochs, rates), and one run's details (default: the active
        run): throughput over time, per-read reward and staleness, failures by type with an example, engine
        latency, rollout duration and hand-over delay histograms, leases, drops."""
        try:
            return await dashboard_data(state_of(request).store, run_id, reads=reads)
        except UnknownRun:
            return error_response(404, f"unknown run_id {run_id!r}")

    app.include_router(router)
