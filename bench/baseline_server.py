"""`rollout-buffer serve` with the ingest benchmark's baselines mounted, run as
`python -m bench.baseline_server serve ARGS...` (the CLI's arguments): the product app, built and served
exactly as `serve` builds and serves it, plus two routes the product does not have:

* `POST /_bench/parse_only`: the same body parsing as `/buffer/write`, and nothing else (nothing stored);
* `POST /_bench/read_only`: the HTTP limit of this stack: read the body, parse nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from rollout_buffer import cli
from rollout_buffer.api import app as app_module
from rollout_buffer.api.bodies import parse_body_with
from rollout_buffer.settings import Settings
from rollout_buffer.wire.record_parsing import parse_record

router = APIRouter(include_in_schema=False)
_create_app = app_module.create_app


@router.post("/_bench/parse_only")
async def bench_parse_only(request: Request) -> Any:
    """The same body parsing as /buffer/write, and nothing else."""
    parsed = await parse_body_with(request, parse_record)
    return {"success": True, "message": "parsed", "data": {"uid": parsed.record.uid}}


@router.post("/_bench/read_only")
async def bench_read_only(request: Request) -> Any:
    """Read the body, parse nothing."""
    body = await request.body()
    return {"success": True, "message": "read", "data": {"bytes": len(body)}}


def create_app_with_baselines(settings: Settings) -> FastAPI:
    app = _create_app(settings)
    app.include_router(router)
    return app


def main(argv: list[str] | None = None) -> int:
    # `cli.serve` looks the factory up when it runs: the one app it builds gets the baselines too
    app_module.create_app = create_app_with_baselines
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
