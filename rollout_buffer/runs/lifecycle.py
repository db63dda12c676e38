"""Run lifecycle: turning a `/start_rollout` body into a stored run and handing it to the runtime.

A run's id is derived from the settings that define its data (task, input file, epochs, repeats,
sampling), so the same `/start_rollout` sent again lands on the same run. What the trainer has trained is
a set of groups, each `"<epoch>:<instance_id>"`:

* `skip_groups` names them exactly (this project's adapter sends `meta_info.finished_group_keys` back);
* `skip_instance_ids` is slime's form: one instance id per trained group, so an id listed k times stands
  for k of its groups (those the buffer handed over, else its first epochs), as slime's own generator
  reads that list;
* neither field (the buffer restarted under a live trainer, or a hand-written request): every group the
  buffer has handed over counts as trained.

A start that names what was trained (either field, even empty: a trainer with no checkpoint) is the
truth. If the buffer handed over groups the trainer does not have, they were lost with a crashed trainer,
so the run is superseded by a new generation (`<id>.r<n>`) that rolls out every group except exactly the
trained ones: each group is trained once, none skipped, none twice. Otherwise the same run carries on,
and batches leased to the previous trainer session end at once (one trainer per run): a batch whose groups
the trainer names as trained is acknowledged (its ack died with the previous session, after the checkpoint
that holds them), the other groups go back to the ready list. A run that
retention deleted is found by its tombstone (`rollout_buffer.runs.retention`): the chain of generations still
leads to the newest one, and a deleted newest generation comes back with its handed-over and trained groups.

The trainer's `policy_version` and `rollout_batch_size` are not part of a run's identity; its staleness
bound and group filter are (`rollout_buffer.runs.policy`), and are checked before anything is stored.

Pass `run_id` explicitly to start a separate run with the same settings. A run started with
`"activate": false` (the adapter's evaluation runs) does not become the active run, the one that writes
and reads without a `run_id` go to; its data is reached by its `run_id` only.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from rollout_buffer.archive import config as archive_config
from rollout_buffer.runs import retention
from rollout_buffer.runs.policy import PolicyError, RunPolicy
from rollout_buffer.security.access import AccessDenied, AccessPolicy
from rollout_buffer.security.outbound import buffer_url_for, checked_engine_urls
from rollout_buffer.store import handover, keys
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.contract import VALIDATE_LINES, InvalidSample, ServerFacts
from rollout_buffer.tasks.discovery import TaskModule, TaskRegistry
from rollout_buffer.tasks.harbor_network import network_warnings
from rollout_buffer.tasks.harbor_toml import TaskLimits
from rollout_buffer.tasks.input_file import InputFileError, iter_lines
from rollout_buffer.tasks.input_keys import InputKeyError, InputKeys, normalise
from rollout_buffer.wire.schema import StartRolloutRequest

log = logging.getLogger(__name__)

# Fields that do not change what a run produces, so they do not change its id.
_NOT_IDENTITY = {"skip_instance_ids", "skip_groups", "remote_buffer_url", "remote_engine_url", "num_process",
                 "run_id", "activate", "policy_version", "rollout_batch_size", "archive"}
# no leading '.': `.` and `..` are not run ids (they name folders wherever a run id becomes a path)
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}$")


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
    excluded_groups: set[str] = field(default_factory=set)
    policy: RunPolicy | None = None
    warnings: list[str] = field(default_factory=list)  # what the input's Harbor tasks ask for that is not honoured

    @property
    def group_size(self) -> int:
        return self.request.num_repeat_per_sample


class Runtime(Protocol):
    """Runs the rollouts of a run. `launch` must be idempotent: a run launched again resumes."""

    async def check(self, request: StartRolloutRequest, task: TaskModule) -> None:
        """Raise StartRolloutError for a request that cannot run; called before anything is stored."""
        ...

    async def launch(self, spec: RunSpec) -> None: ...

    async def shutdown(self) -> None: ...


def derive_run_id(request: StartRolloutRequest) -> str:
    identity = {k: v for k, v in request.model_dump().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha1(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
    task = re.sub(r"[^A-Za-z0-9_.\-]", "_", request.task_type)[:48]
    return f"{task}-{digest}"


def validate_start(request: StartRolloutRequest, registry: TaskRegistry,
                   access: AccessPolicy | None = None, own_url: str = "") -> TaskModule:
    """Check what pydantic cannot: the task exists, the input file is a readable file under the input
    roots (it is replaced by its real path, so every later read opens the file that was checked), every
    engine URL is one the server may call, and a slime-style module's buffer URL is the server's own
    (`own_url`) or one `--allow-url` allows (`rollout_buffer.security.outbound`), for every task kind: a
    native task's agents get it as their base URL. `access` defaults to the current
    directory as the only root."""
    task = registry.get(request.task_type)
    if task is None:
        known = ", ".join(sorted(registry.tasks)) or "none"
        raise StartRolloutError("task_type", f"unknown task_type {request.task_type!r} (known: {known})")
    if request.run_id is not None and not RUN_ID_RE.match(request.run_id):
        raise StartRolloutError("run_id", "must be 1-128 characters of letters, digits, '_', '.', '-', not starting "
                                         "with '.'")
    access = access or AccessPolicy(roots=(Path.cwd().resolve(),))
    try:
        request.input_file = access.input_file(request.input_file)
        checked_engine_urls(access, request.remote_engine_url)
        if (request.model_extra or {}).get("concurrency_load_urls"):  # the engines behind a router, polled for load
            checked_engine_urls(access, request.model_extra["concurrency_load_urls"], "concurrency_load_urls")
        # a legacy module is handed the URL with the run's write key in it; a native one hands it to the agents
        # of its `ctx.session()` with their session keys: either way it is the server's own or an allowed one
        if task.kind == "legacy" or request.remote_buffer_url:
            request.remote_buffer_url = buffer_url_for(access, request.remote_buffer_url, own_url)
        elif own_url:
            request.remote_buffer_url = own_url
    except AccessDenied as exc:
        raise StartRolloutError(exc.field, str(exc), exc.status_code) from exc
    return task


def activates(request: StartRolloutRequest) -> bool:
    """Whether the run becomes the active one: yes unless the body says `"activate": false` (or "false")."""
    value = (request.model_extra or {}).get("activate", True)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no")
    return bool(value)  # `rollout_buffer.runs.start_fields` refused anything but a boolean at the start


def check_input_lines(request: StartRolloutRequest, task: TaskModule,
                      server: ServerFacts | None = None) -> list[str]:
    """Refuse an input file the task cannot read, before anything is stored: every line must parse (JSON,
    unique ids), and the first `VALIDATE_LINES` lines, mapped with the run's slime keys
    (`rollout_buffer.tasks.input_keys`), must pass the task's `validate_sample`. A native task's lines are always
    mapped (bad `metadata` / `tools` shapes are refused); a legacy task's only when it defines the hook. Returns
    the warnings of the file's Harbor tasks (each naming its task)."""
    try:
        keys = InputKeys.from_options(request.model_extra or {})
    except InputKeyError as exc:
        raise StartRolloutError(exc.field, str(exc)) from exc
    check_run = task.hook("validate_run")
    if check_run is not None:  # the task's own run options (e.g. agent_command's `agent`)
        try:
            if _takes_server(check_run):
                check_run(dict(request.model_extra or {}), server or ServerFacts())
            else:
                check_run(dict(request.model_extra or {}))
        except InvalidSample as exc:
            raise StartRolloutError(exc.field, exc.reason, exc.status_code) from exc
    validate = task.validate_sample
    if task.kind != "native" and validate is None:
        return []
    head: list[tuple[int, dict[str, Any]]] = []
    warnings: list[str] = []
    try:  # the whole file parses (JSON, ids) before any line is judged
        for index, item in enumerate(iter_lines(request.input_file, (server or ServerFacts()).task_limits)):
            if index < VALIDATE_LINES:
                head.append(item)
            harbor = item[1].get("harbor")
            if isinstance(harbor, dict):
                warnings += [f"task {harbor.get('name')!r}: {w}" for w in [
                    *(harbor.get("warnings") or ()), *network_warnings(harbor.get("network"), (server or ServerFacts()).egress)]]
    except InputFileError as exc:
        raise StartRolloutError("input_file", str(exc)) from exc
    for number, line in head:
        try:
            sample = normalise(line, keys)
            if validate is not None:
                validate(sample)
        except Exception as exc:  # noqa: BLE001 - a task's check may raise anything; its message is the reason
            raise StartRolloutError("input_file", _line_refusal(request, task, keys, number, line, exc)) from exc
    return warnings


def _takes_server(hook: Any) -> bool:
    """Whether a `validate_run` hook takes the server's facts as a second argument."""
    try:
        return len(inspect.signature(hook).parameters) >= 2
    except (TypeError, ValueError):
        return False


def _line_refusal(request: StartRolloutRequest, task: TaskModule, keys: InputKeys, number: int,
                  line: dict[str, Any], exc: Exception) -> str:
    where = f"{request.input_file} line {number}"
    if isinstance(exc, InvalidSample):
        hint = f"; the line has keys {sorted(line)}" if exc.reason.startswith("missing") else ""
        return (f"{where}: field {keys.source_of(exc.field, line)}: {exc.reason}{hint} "
                f"(task {task.task_type!r} cannot use this line)")
    return f"{where}: task {task.task_type!r} cannot use this line: {type(exc).__name__}: {exc}"


async def _current_generation(store: Store, run_id: str) -> tuple[str, int]:
    """Follow `superseded_by` links to the run's newest generation; returns (id, generation number)."""
    generation = 0
    for _ in range(10_000):
        successor = (await store.run_meta(run_id)).get("superseded_by")
        if not successor:
            return run_id, generation
        run_id, generation = successor, generation + 1
    raise RuntimeError(f"run {run_id}: superseded_by links form a cycle")


def names_trained_groups(request: StartRolloutRequest) -> bool:
    """Whether the start says what the trainer has trained (either skip field sent, even empty)."""
    return bool({"skip_groups", "skip_instance_ids"} & request.model_fields_set)


def trained_groups(request: StartRolloutRequest, handed: set[str]) -> set[str]:
    """The group keys the trainer has trained: `skip_groups`, plus slime's `skip_instance_ids` read as one
    entry per trained group (see the module docstring); `handed` is what the buffer handed over."""
    trained = set(request.skip_groups)
    handed_epochs: dict[str, list[int]] = {}
    for key in handed:
        epoch, instance_id = keys.parse_gid(key)
        handed_epochs.setdefault(instance_id, []).append(epoch)
    for instance_id, count in Counter(request.skip_instance_ids).items():
        epochs = sorted(handed_epochs.get(instance_id, []))[:count]
        spare = (e for e in range(request.num_epoch) if e not in epochs)
        epochs += [e for e, _ in zip(spare, range(count - len(epochs)))]
        trained.update(keys.gid(e, instance_id) for e in epochs)
    return trained


async def start_run(store: Store, registry: TaskRegistry, request: StartRolloutRequest,
                    runtime: Runtime | None = None, access: AccessPolicy | None = None,
                    own_url: str = "", task_limits: TaskLimits | None = None,
                    archive_dir: Path | None = None) -> RunSpec:
    """Create (or find) the run, record what was trained, make it the active run. Launching is the
    caller's. Everything that can refuse the request runs before anything is stored. `own_url`: the
    server's own address, what a slime-style module writes to unless the body names an allowed URL.
    `archive_dir`: the server's archive folder (`rollout_buffer.archive.config`)."""
    task = validate_start(request, registry, access, own_url)
    try:
        policy = RunPolicy.from_request(request, task.kind)
    except PolicyError as exc:
        raise StartRolloutError(exc.field, exc.message) from exc
    archive_option = (request.model_extra or {}).get("archive")
    try:  # checked now (refused before anything is stored); the folder is the run's own, known below
        archive_config.run_folder(archive_option, "run", server_dir=archive_dir,
                                  roots=access.roots if access is not None else ())
    except archive_config.ArchiveOptionError as exc:
        raise StartRolloutError("archive", str(exc)) from exc
    if runtime is not None:
        await runtime.check(request, task)
    server = (ServerFacts(agent_sandboxes=access.agent_sandboxes, input_roots=tuple(str(r) for r in access.roots),
                          egress_agent=access.egress_agent, egress_verifier=access.egress_verifier,
                          egress_proxy=access.egress_proxy, egress_mirror=access.egress_mirror,
                          egress_build=access.egress_build,
                          task_limits=task_limits,
                          allowed_urls=tuple(access.allowed_urls))
              if access is not None else ServerFacts(task_limits=task_limits))
    warnings = await asyncio.to_thread(check_input_lines, request, task, server)
    base_id = request.run_id or derive_run_id(request)
    run_id, generation = await _current_generation(store, base_id)
    exists = await store.run_exists(run_id)
    # a run retention deleted keeps its handed and skip sets under a tombstone (`retention`): it comes back
    handed = await store.handed_groups(run_id)
    # slime's per-id form counts leased groups as handed over: the last batch may be trained, not acked yet
    leased = await handover.leased_groups(store, run_id) if request.skip_instance_ids else set()
    trained = trained_groups(request, handed | leased) if names_trained_groups(request) else set()
    if handed and names_trained_groups(request):
        untrained = handed - trained
        if untrained:
            successor = f"{base_id}.r{generation + 1}"
            reason = f"{len(untrained)} handed-over group(s) missing from what the trainer says it trained"
            if exists:
                await store.supersede(run_id, successor, reason=reason)
            else:
                await retention.retire_tombstone(store, run_id, successor, reason)
            log.warning("run %s superseded by %s: %d group(s) were handed over to a trainer that does not have "
                        "them; the new generation rolls out everything the trainer has not trained",
                        run_id, successor, len(untrained))
            run_id, exists = successor, False
    config: dict[str, Any] = request.model_dump()
    config["run_id"] = run_id
    archive_folder = archive_config.run_folder(archive_option, run_id, server_dir=archive_dir,
                                               roots=access.roots if access is not None else ())
    created = await store.create_run(
        run_id, config, group_size=request.num_repeat_per_sample, num_epoch=request.num_epoch,
        task_type=request.task_type,
        extra_meta={**policy.meta(), **({"archive_dir": archive_folder} if archive_folder else {})},
    )
    if not created and policy.policy_version is not None:
        await store.set_policy_version(run_id, policy.policy_version)
    await store.add_skip_groups(run_id, trained)
    if not created:
        ended = await handover.end_trainer_session(store, run_id)
        if ended.acked or ended.handed_groups or ended.released:
            log.info("run %s: a new trainer session acknowledged %d leased batch(es) it had trained (%d more "
                     "trained group(s) of partly trained ones handed over) and released %d", run_id, ended.acked,
                     ended.handed_groups, ended.released)
    if activates(request):
        await store.set_active_run(run_id)
    excluded = await store.skip_groups(run_id) | await store.handed_groups(run_id)
    if warnings:
        log.warning("run %s: %d warning(s) about its tasks: %s", run_id, len(warnings), " | ".join(warnings))
    return RunSpec(run_id=run_id, request=request, task=task, created=created, excluded_groups=excluded,
                   policy=policy, warnings=warnings)
