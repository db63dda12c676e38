"""The server's runtime: launching runs (validate, enqueue, announce) plus the server's rollout workers.

`launch` is idempotent: a run whose tasks are all enqueued enqueues nothing again, so a trainer re-sending
`/start_rollout` after a server restart resumes the run where the stream left off. The server's workers are
`--worker-processes N` processes beside it (`supervisor.WorkerSupervisor`, the default), or with
`--worker-processes 0` the same `WorkerPool` inside the API process (`--workers N` loops); `--workers 0`
runs none (API only). Either way they are the `WorkerPool` that `rollout-buffer worker` runs elsewhere.

Legacy (slime-style) modules are their own workers: their `run_rollout` always runs in a thread of the
serving process that received `/start_rollout`, whatever `--workers` says.
"""

from __future__ import annotations

import asyncio
import logging

from rollout_buffer.runs import RunSpec, StartRolloutError
from rollout_buffer.runtime.inputs import read_samples
from rollout_buffer.runtime.legacy import LegacyRunner
from rollout_buffer.runtime.options import RunOptions
from rollout_buffer.runtime.supervisor import WorkerSupervisor, redis_url_of
from rollout_buffer.runtime.taskqueue import TaskQueue
from rollout_buffer.runtime.tokenizers import check_tokenizer_in_child, get_tokenizer
from rollout_buffer.runtime.worker import WorkerPool, publish_run
from rollout_buffer.schema import StartRolloutRequest
from rollout_buffer.settings import Settings
from rollout_buffer.store import Store
from rollout_buffer.tasks import TaskModule, TaskRegistry

log = logging.getLogger(__name__)


class RolloutRuntime:
    """Implements `rollout_buffer.runs.Runtime` for native and legacy task modules."""

    def __init__(self, store: Store, registry: TaskRegistry, settings: Settings, *, worker_loops: int | None = None,
                 pool_name: str | None = None) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        loops = settings.workers if worker_loops is None else worker_loops
        processes = settings.worker_processes if loops > 0 and worker_loops is None else 0
        in_process = loops > 0 and processes == 0
        self.pool = WorkerPool(store, registry, settings, loops=loops, name=pool_name) if in_process else None
        # Worker processes reach the Redis the API uses: --redis-url, or the embedded one (started by now).
        self.supervisor = (WorkerSupervisor(settings, processes, redis_url=redis_url_of(settings))
                           if processes > 0 else None)
        self.legacy = LegacyRunner(store)
        self._lock = asyncio.Lock()

    def start(self) -> None:
        """Start the workers (they resume every running run they find); needs the running event loop."""
        if self.pool is not None:
            self.pool.start()
        if self.supervisor is not None:
            self.supervisor.start()

    async def check(self, request: StartRolloutRequest, task: TaskModule) -> None:
        """Everything that can refuse a run, before the run is stored: options, tokenizer, input file."""
        if task.kind == "legacy":
            if not request.remote_buffer_url:
                raise StartRolloutError("remote_buffer_url", "a legacy task module needs the buffer's URL to write to")
            return
        options = RunOptions.from_request(request, rollout_timeout_s=self.settings.rollout_timeout_s)
        options.check_launchable("native")
        if options.engine_api == "generate" and options.tokenizer_path:
            try:
                if self.pool is not None:  # this process rolls out too: keep the tokenizer
                    await get_tokenizer(options.tokenizer_path)
                else:  # worker processes (or other hosts) do: prove it loads, in a child process
                    await check_tokenizer_in_child(options.tokenizer_path)
            except Exception as exc:
                raise StartRolloutError("tokenizer_path", f"cannot load a tokenizer with a chat template "
                                                          f"from {options.tokenizer_path!r}: {exc}") from exc
        await asyncio.to_thread(read_samples, request.input_file)

    async def launch(self, spec: RunSpec) -> None:
        """Start or resume a run that `check` accepted (the API checks before it stores the run)."""
        self.start()
        if spec.task.kind == "legacy":
            await self._launch_legacy(spec)
        else:
            await self._launch_native(spec)

    async def _launch_legacy(self, spec: RunSpec) -> None:
        if (await self.store.run_meta(spec.run_id)).get("status") != "running":
            return  # finished, failed or superseded: re-sending /start_rollout does not roll it out again
        if self.legacy.launch(spec):
            log.info("run %s: legacy task %s started in a thread", spec.run_id, spec.task.task_type)

    async def _launch_native(self, spec: RunSpec) -> None:
        queue = TaskQueue(self.store.redis, spec.run_id)
        async with self._lock:  # one enqueuer per process; the Lua script makes several processes safe too
            if not await queue.enqueue_done():
                samples = await asyncio.to_thread(read_samples, spec.request.input_file)
                keep_order = spec.policy is not None and spec.policy.group_filter is not None
                added = await queue.enqueue(samples, num_epoch=spec.request.num_epoch,
                                            repeats=spec.request.num_repeat_per_sample, excluded=spec.excluded_groups,
                                            keep_order=keep_order)
                log.info("run %s: enqueued %d task(s) for %d line(s)", spec.run_id, added, len(samples))
        await publish_run(self.store, spec.run_id)
        if self.pool is not None:
            self.pool.watch(spec.run_id)

    async def shutdown(self) -> None:
        log.debug("runtime shutting down")
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.pool is not None:
            await self.pool.close()
        await self.legacy.shutdown()
        log.debug("runtime shut down")


def build_runtime(store: Store, registry: TaskRegistry, settings: Settings) -> RolloutRuntime:
    """The default runtime factory of `rollout_buffer.api.create_app`."""
    runtime = RolloutRuntime(store, registry, settings)
    try:
        runtime.start()
    except RuntimeError:  # no running event loop yet: workers start on the first launch
        pass
    return runtime
