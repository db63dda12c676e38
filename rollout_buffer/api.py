"""Every HTTP route of the buffer, in one file. The routes are thin: the work is in `runs`, `store`,
`reads` and the runtime."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import ORJSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from rollout_buffer import __version__
from rollout_buffer.bodies import install_openapi, json_body, parse_body
from rollout_buffer.embedded_redis import EmbeddedRedis
from rollout_buffer.http_errors import (
    BodySizeLimit,
    error_response,
    install_error_handlers,
)
from rollout_buffer.packed_batch import (
    CONTENT_TYPE,
    PackedBatchError,
    decode_batch,
    stamped_blob,
)
from rollout_buffer.reads import read_rollout_data
from rollout_buffer.remote import RemoteService
from rollout_buffer.remote import router as remote_router
from rollout_buffer.runs import Runtime, StartRolloutError, start_run
from rollout_buffer.schema import (
    BatchWriteRequest,
    GetRolloutDataRequest,
    StartRolloutRequest,
    TrajectoryRecord,
)
from rollout_buffer.settings import Settings
from rollout_buffer.store import Store, WriteOutcome
from rollout_buffer.tasks import TaskRegistry, discover

log = logging.getLogger(__name__)

RuntimeFactory = Callable[[Store, TaskRegistry, Settings], Runtime]


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: TaskRegistry
    runtime: Runtime
    embedded: EmbeddedRedis | None
    metrics: CollectorRegistry
    writes: Counter
    reads: Counter
    run_stats: Gauge


def _default_runtime(store: Store, registry: TaskRegistry, settings: Settings) -> Runtime:
    from rollout_buffer.runtime import build_runtime

    return build_runtime(store, registry, settings)


async def _sweep_group_timeouts(state: AppState) -> None:
    """Applies the group-timeout policy to the active run's incomplete groups, a few times a timeout."""
    timeout = state.settings.group_timeout_s
    assert timeout is not None
    while True:
        await asyncio.sleep(max(timeout / 4, 0.05))
        try:
            run_id = await state.store.active_run()
            if run_id:
                await state.store.expire_groups(run_id, timeout, state.settings.group_timeout_policy)
        except Exception:
            log.exception("group timeout sweep failed")


def tune_gc() -> None:
    """Fewer, cheaper garbage collections. In-flight requests hold parsed records (thousands of objects
    each) across Redis awaits, so the default gen0 threshold (700 allocations) makes the collector run
    constantly and re-scan them; objects alive after start-up are moved out of its view. Measured: +40%
    /buffer/write throughput (bench/ingest.py). Reference counting still frees all acyclic garbage at once."""
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def batch_answer(state: AppState, run_id: str, uids: list[str], outcomes: list[WriteOutcome]) -> dict[str, Any]:
    """The answer of the batch write routes: one result per record, in order, and counts."""
    results = []
    for uid, outcome in zip(uids, outcomes):
        state.writes.labels(outcome.outcome).inc()
        results.append({"uid": uid, "outcome": outcome.outcome, "reason": outcome.reason,
                        "group_completed": outcome.outcome == "completed"})
    counts = {name: sum(1 for o in outcomes if o.outcome == name) for name in ("stored", "completed", "duplicate", "dropped")}
    return {"success": counts["dropped"] == 0, "run_id": run_id,
            "message": f"{counts['stored'] + counts['completed']} stored, {counts['duplicate']} duplicate(s), "
                       f"{counts['dropped']} dropped",
            "data": {"results": results, **counts}}


def create_app(settings: Settings | None = None, runtime_factory: RuntimeFactory | None = None) -> FastAPI:
    """The ASGI app. Start-up opens Redis (embedded unless `redis_url`), discovers tasks, starts the runtime."""
    settings = settings or Settings()
    factory = runtime_factory or _default_runtime

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        embedded = None
        url = settings.redis_url
        if url is None:
            embedded = EmbeddedRedis(settings.data_dir, appendfsync=settings.appendfsync)
            url = await asyncio.to_thread(embedded.start)
        registry = discover(settings.task_dir)
        for path, error in registry.errors.items():
            log.error("task module problem: %s: %s", path, error)
        store = Store.from_url(url)
        metrics = CollectorRegistry()
        state = AppState(
            settings=settings, store=store, registry=registry, runtime=factory(store, registry, settings),
            embedded=embedded, metrics=metrics,
            writes=Counter("rollout_buffer_writes", "Record writes by outcome", ["outcome"], registry=metrics),
            reads=Counter("rollout_buffer_reads", "Reads of rollout data by result", ["result"], registry=metrics),
            run_stats=Gauge("rollout_buffer_run", "Totals of the active run, from Redis", ["run_id", "stat"],
                            registry=metrics),
        )
        app.state.buffer = state
        app.state.remote = RemoteService(store, registry, settings)
        await app.state.remote.start()  # also resumes or reports /init rollouts a dead process left
        sweeper = asyncio.create_task(_sweep_group_timeouts(state)) if settings.group_timeout_s else None
        tune_gc()
        log.info("rollout-buffer ready on redis %s with tasks %s", url, sorted(registry.tasks))
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await app.state.remote.stop()
            await state.runtime.shutdown()
            await store.close()
            if embedded is not None:
                await asyncio.to_thread(embedded.stop)

    app = FastAPI(title="rollout-buffer", version=__version__, lifespan=lifespan,
                  default_response_class=ORJSONResponse)
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(remote_router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    def state_of(request: Request) -> AppState:
        return request.app.state.buffer

    @app.post("/start_rollout")
    async def start_rollout(body: StartRolloutRequest, request: Request) -> Any:
        """Start a run (or find the same one already running) and launch its rollouts."""
        state = state_of(request)
        if not body.remote_buffer_url:  # legacy task modules write back to us; tell them where
            body.remote_buffer_url = str(request.base_url).rstrip("/")
        try:
            spec = await start_run(state.store, state.registry, body, state.runtime)
            await state.runtime.launch(spec)
        except StartRolloutError as exc:
            return error_response(exc.status_code, str(exc), [{"field": exc.field, "message": str(exc)}])
        verb = "started" if spec.created else "already exists; resumed"
        return {"message": f"run {spec.run_id} {verb}", "run_id": spec.run_id, "created": spec.created,
                "skipped_instance_ids": len(spec.excluded_ids)}

    @app.post("/buffer/write", openapi_extra=json_body(TrajectoryRecord))
    async def buffer_write(request: Request) -> Any:
        """Store one trajectory; idempotent by uid. Attaches to the active run unless `run_id` is given."""
        record = await parse_body(request, TrajectoryRecord)
        state = state_of(request)
        run_id = record.run_id or await state.store.active_run()
        if run_id is None:
            return error_response(409, "no active run: start one with POST /start_rollout "
                                       "(or give the record a run_id)")
        outcome = await state.store.write_record(run_id, record.to_store())
        if outcome.reason == "unknown_run":  # checked inside the write script: no extra round trip
            return error_response(404, f"unknown run_id {run_id!r}")
        state.writes.labels(outcome.outcome).inc()
        data = {"uid": record.uid, "run_id": run_id, "outcome": outcome.outcome}
        if outcome.outcome == "dropped":
            if outcome.reason == "skipped_instance":
                return {"success": False, "message": f"instance {record.instance_id} is skipped in this run; "
                                                     "not stored (counted)", "data": data}
            return error_response(409, f"record {record.uid} not stored: {outcome.reason.replace('_', ' ')} "
                                       f"(group of instance {record.instance_id} is closed or full)")
        message = "already stored (duplicate uid)" if outcome.outcome == "duplicate" else "stored"
        return {"success": True, "message": message, "data": {**data, "group_completed": outcome.outcome == "completed"}}

    @app.post("/buffer/write_batch", openapi_extra=json_body(BatchWriteRequest))
    async def buffer_write_batch(request: Request) -> Any:
        """Store many trajectories in one request and one Redis round trip; same rules as /buffer/write.
        The whole batch is validated first: one bad record refuses the batch and stores nothing."""
        body = await parse_body(request, BatchWriteRequest)
        state = state_of(request)
        run_id = body.run_id or await state.store.active_run()
        if run_id is None:
            return error_response(409, "no active run: start one with POST /start_rollout (or give run_id)")
        if not await state.store.run_exists(run_id):
            return error_response(404, f"unknown run_id {run_id!r}")
        foreign = [r.uid for r in body.records if r.run_id not in (None, run_id)]
        if foreign:
            return error_response(422, f"records {foreign[:5]} name another run than {run_id!r}")
        outcomes = await state.store.write_records(run_id, [r.to_store() for r in body.records])
        return batch_answer(state, run_id, [r.uid for r in body.records], outcomes)

    @app.post("/buffer/write_packed", openapi_extra={"requestBody": {"required": True, "content": {
        CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
    async def buffer_write_packed(request: Request, run_id: str | None = None) -> Any:
        """Store many records sent in the store's packed binary form (see `rollout_buffer.packed_batch`):
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
            return error_response(404, f"unknown run_id {run_id!r}")
        outcomes = await state.store.write_records(run_id, [i.fields for i in items],
                                                   blobs=[stamped_blob(i, run_id) for i in items])
        return batch_answer(state, run_id, [i.fields["uid"] for i in items], outcomes)

    if settings.bench_routes:
        @app.post("/_bench/parse_only", include_in_schema=False)
        async def bench_parse_only(request: Request) -> Any:
            """Benchmark baseline: the same body parsing as /buffer/write, and nothing else."""
            record = await parse_body(request, TrajectoryRecord)
            return {"success": True, "message": "parsed", "data": {"uid": record.uid}}

    @app.post("/get_rollout_data")
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

    @app.get("/health")
    async def health(request: Request) -> Any:
        state = state_of(request)
        await state.store.redis.ping()
        return {"status": "ok", "version": __version__, "embedded_redis": state.embedded is not None}

    @app.get("/tasks")
    async def tasks(request: Request) -> Any:
        """Discovered task modules, and the modules that failed to load with their errors."""
        return state_of(request).registry.describe()

    @app.get("/runs")
    async def runs(request: Request) -> Any:
        state = state_of(request)
        return {"runs": await state.store.list_runs(), "active_run": await state.store.active_run()}

    @app.get("/runs/{run_id}")
    async def run_detail(run_id: str, request: Request) -> Any:
        """Tasks, groups and drops of one run."""
        state = state_of(request)
        meta = await state.store.run_meta(run_id)
        if not meta:
            return error_response(404, f"unknown run_id {run_id!r}")
        stats = await state.store.stats(run_id)
        counts = await state.store.group_counts(run_id)
        return {
            "run_id": run_id,
            "meta": meta,
            "config": await state.store.run_config(run_id),
            "tasks": {name: int(stats.get(f"tasks_{name}", 0)) for name in ("queued", "running", "done", "failed")},
            "groups": {
                "pending": counts["pending"],
                "ready": counts["ready"],
                "completed": int(stats.get("groups_completed", 0)),
                "consumed": int(stats.get("groups_handed", 0)),
                "filtered": int(stats.get("groups_filtered", 0)),
                "timed_out_handed": int(stats.get("groups_timed_out_handed", 0)),
            },
            "records": {"written": int(stats.get("records_written", 0)),
                        "duplicates": int(stats.get("duplicate_writes", 0)),
                        "by_status": {k.split(":", 1)[1]: int(v) for k, v in stats.items() if k.startswith("status:")}},
            "drops": {k.split(":", 1)[1]: int(v) for k, v in stats.items() if k.startswith("drop:")},
            "stats": stats,
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Any:
        """Prometheus text: this process's counters, and the active run's totals from Redis (drops by
        reason, groups, records) as `rollout_buffer_run{run_id, stat}`."""
        state = state_of(request)
        run_id = await state.store.active_run()
        if run_id:
            for name, value in (await state.store.stats(run_id)).items():
                state.run_stats.labels(run_id, name).set(value)
        return PlainTextResponse(generate_latest(state.metrics), media_type=CONTENT_TYPE_LATEST)

    return app
