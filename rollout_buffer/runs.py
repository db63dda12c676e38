"""Run lifecycle: turning a `/start_rollout` body into a stored run and handing it to the runtime.

A run's id is derived from the settings that define its data (task, input file, epochs, repeats,
sampling), so the trainer re-sending the same `/start_rollout` after a crash lands on the same run: it
starts nothing new, and the instance ids already handed over are skipped without being told. Pass
`run_id` explicitly to start a separate run with the same settings.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from rollout_buffer.schema import StartRolloutRequest
from rollout_buffer.store import Store
from rollout_buffer.tasks import TaskModule, TaskRegistry

# Fields that do not change what a run produces, so they do not change its id.
_NOT_IDENTITY = {"skip_instance_ids", "remote_buffer_url", "remote_engine_url", "num_process", "run_id"}
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class StartRolloutError(ValueError):
    """A `/start_rollout` body that names something unusable; `field` is the culprit."""

    def __init__(self, field_name: str, message: str, status_code: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status_code = status_code


@dataclass
class RunSpec:
    """Everything the runtime needs to run (or resume) one run."""

    run_id: str
    request: StartRolloutRequest
    task: TaskModule
    created: bool
    excluded_ids: set[str] = field(default_factory=set)

    @property
    def group_size(self) -> int:
        return self.request.num_repeat_per_sample


class Runtime(Protocol):
    """Runs the rollouts of a run. `launch` must be idempotent: a run launched again resumes."""

    async def launch(self, spec: RunSpec) -> None: ...

    async def shutdown(self) -> None: ...


class NoRuntime:
    """Runs nothing: the run's records come from `/buffer/write` callers."""

    async def launch(self, spec: RunSpec) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def derive_run_id(request: StartRolloutRequest) -> str:
    identity = {k: v for k, v in request.model_dump().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha1(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
    task = re.sub(r"[^A-Za-z0-9_.\-]", "_", request.task_type)[:48]
    return f"{task}-{digest}"


def validate_start(request: StartRolloutRequest, registry: TaskRegistry) -> TaskModule:
    """Check what pydantic cannot: the task exists, the input file is readable."""
    task = registry.get(request.task_type)
    if task is None:
        known = ", ".join(sorted(registry.tasks)) or "none"
        raise StartRolloutError("task_type", f"unknown task_type {request.task_type!r} (known: {known})")
    if request.run_id is not None and not _RUN_ID_RE.match(request.run_id):
        raise StartRolloutError("run_id", "must be 1-128 characters of letters, digits, '_', '.', '-'")
    path = request.input_file
    if not os.path.isfile(path):
        raise StartRolloutError("input_file", f"{path!r} does not exist or is not a file")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise StartRolloutError("input_file", f"{path!r} is not readable: {exc.strerror}") from exc
    return task


async def start_run(store: Store, registry: TaskRegistry, request: StartRolloutRequest) -> RunSpec:
    """Create (or find) the run, record skip ids, make it the active run. Launching is the caller's."""
    task = validate_start(request, registry)
    run_id = request.run_id or derive_run_id(request)
    config: dict[str, Any] = request.model_dump()
    config["run_id"] = run_id
    created = await store.create_run(
        run_id, config, group_size=request.num_repeat_per_sample, num_epoch=request.num_epoch,
        task_type=request.task_type,
    )
    await store.add_skip_ids(run_id, request.skip_instance_ids)
    await store.set_active_run(run_id)
    excluded = await store.excluded_ids(run_id)
    return RunSpec(run_id=run_id, request=request, task=task, created=created, excluded_ids=excluded)
