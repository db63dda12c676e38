"""Runs remote rollouts in the API process: claim, drive the task, report once, recover after restarts.

Life of a rollout_id: `/init` claims it (`queued`, owned by this process), a background task moves it to
`running` and runs the task module's `rollout(sample, ctx)` against the trainer, then it becomes
`completed` or `error` with its callback body stored, and the callback is delivered (`delivered`).

Recovery: each API process holds an ownership key with a TTL, renewed by a heartbeat. At start-up and then
periodically, every unsettled rollout whose owner's key has lapsed is taken over (an owner-checked
compare-and-set, so only one process wins): `queued` ones are run (the trainer has seen no call yet),
`running` ones are reported as ERROR ("buffer restarted"; the trainer already holds part of them, so they
cannot be replayed), finished ones get their stored callback (re)delivered under the same idempotency key.
A settled rollout (callback delivered, or refused for good) leaves the open set and its state expires after
`settled_ttl_s`; the same scan drops the index entries of expired states.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from rollout_buffer.remote.callback import CallbackSender
from rollout_buffer.remote.engine import CallReport, RemoteEngineClient
from rollout_buffer.remote.metrics import RemoteMetrics
from rollout_buffer.remote.schema import InitRequest, callback_body
from rollout_buffer.remote.settings import RemoteSettings
from rollout_buffer.remote.state import RemoteStates, public_view
from rollout_buffer.runtime.engine_http import RetryPolicy, new_session
from rollout_buffer.runtime.history import snapshot
from rollout_buffer.runtime.tokenizers import get_tokenizer
from rollout_buffer.security.access import AccessDenied, AccessPolicy
from rollout_buffer.settings import Settings
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.contract import RolloutContext
from rollout_buffer.tasks.discovery import TaskRegistry

log = logging.getLogger(__name__)
RESTARTED = "buffer restarted while the rollout was running; it cannot be resumed (the trainer already holds part of it)"
SHUT_DOWN = "buffer shut down while the rollout was running"
ORPHAN_INDEX_GRACE_S = 60.0
SETTLED = ("delivered", "failed")  # callback statuses after which nothing is left to do


class RemoteService:
    """The remote-rollout side of one API process."""

    def __init__(self, store: Store, registry: TaskRegistry, settings: Settings,
                 remote_settings: RemoteSettings | None = None, metrics: CollectorRegistry | None = None) -> None:
        self.registry = registry
        self.settings = settings
        self.config = remote_settings or RemoteSettings()
        self.metrics = RemoteMetrics(metrics)
        self.access = AccessPolicy.from_settings(settings)  # server_url (and its callback), tokenizer_name
        self.states = RemoteStates(store.redis)
        self.owner = uuid.uuid4().hex
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._active: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._sender: CallbackSender | None = None
        self._loops: list[asyncio.Task[None]] = []

    # ----- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take ownership, then take over whatever a dead process left unfinished."""
        self._session = new_session()
        self._sender = CallbackSender(self._session, self.states, self.config, self.owner, access=self.access)
        await self._heartbeat_once()
        try:
            await self.scan_once()
        except Exception:
            log.exception("remote rollouts: start-up scan failed; the periodic scan will retry")
        self._loops = [asyncio.create_task(self._heartbeat_loop(), name="remote-heartbeat"),
                       asyncio.create_task(self._scan_loop(), name="remote-scan")]

    async def stop(self) -> None:
        """Interrupt running rollouts with an ERROR callback (within the grace time), give up ownership."""
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        interrupted = list(self._active.values())
        for task in interrupted:
            task.cancel()
        await asyncio.gather(*interrupted, return_exceptions=True)
        pending = [t for t in self._background if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.config.shutdown_grace_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        try:
            await self.states.release(self.owner)  # a restart takes over at once instead of after the TTL
        except Exception:
            log.exception("remote rollouts: could not give up ownership")
        if self._session is not None:
            await self._session.close()

    async def _heartbeat_once(self) -> None:
        await self.states.heartbeat(self.owner, self.config.owner_ttl_s, f"{socket.gethostname()}:{os.getpid()}")

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.owner_ttl_s / 3)
            try:
                await self._heartbeat_once()
            except Exception:
                log.exception("remote rollouts: heartbeat failed")

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.config.owner_ttl_s / 2, 0.1))
            try:
                await self.scan_once()
            except Exception:
                log.exception("remote rollouts: scan failed")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ----- API ------------------------------------------------------------------------------------

    def task_problem(self, task_type: str) -> str | None:
        """Why `task_type` cannot run a remote rollout, or None."""
        task = self.registry.get(task_type)
        if task is None:
            return f"unknown task_type {task_type!r}; known: {sorted(self.registry.tasks)}"
        if task.kind != "native":
            return f"task_type {task_type!r} is a legacy run_rollout(data) module; /init needs rollout(sample, ctx)"
        return None

    def refusal(self, request: InitRequest) -> AccessDenied | None:
        """Why the server will not run this rollout: a `server_url` outside `--allow-url`, or a tokenizer it
        may not load (a folder outside the input roots, a hub name not cached here); None when it may."""
        try:
            self.access.url("server_url", request.server_url)
            self.access.tokenizer(request.tokenizer_name)
        except AccessDenied as exc:
            if exc.field == "tokenizer_path":
                exc.field = "tokenizer_name"
            return exc
        return None

    async def init(self, request: InitRequest) -> tuple[bool, dict[str, Any]]:
        """Claim and start the rollout, or find it already known: (created, state view)."""
        created = await self.states.claim(request, self.owner)
        if created:
            self._start_rollout(request.rollout_id, request)
        raw = await self.states.get(request.rollout_id)
        assert raw is not None, "a claimed rollout has state"
        view = public_view(raw)
        if not created:
            stored = orjson.loads(raw["request"]) if raw.get("request") else {}
            view["request_matches"] = stored == request.model_dump()
        return created, view

    async def view(self, rollout_id: str) -> dict[str, Any] | None:
        raw = await self.states.get(rollout_id)
        return public_view(raw) if raw else None

    # ----- running one rollout --------------------------------------------------------------------

    def _start_rollout(self, rollout_id: str, request: InitRequest) -> None:
        if rollout_id in self._active:
            return
        task = asyncio.create_task(self._run(request), name=f"remote-rollout-{rollout_id}")
        self._active[rollout_id] = task
        task.add_done_callback(lambda _t: self._active.pop(rollout_id, None))

    async def _run(self, request: InitRequest) -> None:
        rollout_id = request.rollout_id
        async with self._slots:
            if not await self.states.update(rollout_id, self.owner, statuses=("queued",), status="running",
                                            started_at=time.time()):
                log.warning("rollout %s: not queued under this process any more; not run", rollout_id)
                return
            attempt = await self.states.incr(rollout_id, "attempts")
            conversation: list[dict[str, Any]] = list(request.messages)
            try:
                body = await self._execute(request, attempt, conversation)
            except asyncio.CancelledError:
                body = self._error(request, SHUT_DOWN, conversation)
                self._spawn(self._finish(request, body), f"remote-finish-{rollout_id}")
                raise
        await self._finish(request, body)

    async def _execute(self, request: InitRequest, attempt: int, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """Run the task; always returns a callback body (COMPLETED or ERROR)."""
        problem = self.task_problem(request.task_type)
        if problem is not None:
            return self._error(request, problem, conversation)
        try:
            source = self.access.tokenizer(request.tokenizer_name)
            tokenizer = await get_tokenizer(source.name, allow_download=source.allow_download)
        except Exception as exc:  # noqa: BLE001 - whatever the loader raises, the trainer gets the reason
            return self._error(request, f"cannot load tokenizer_name {request.tokenizer_name!r}: "
                                        f"{type(exc).__name__}: {exc}", conversation)
        assert self._session is not None
        rollout_id = request.rollout_id

        async def on_call(report: CallReport) -> None:
            await self.states.record_call(rollout_id, turn=report.turn is not None, counted=report.counted,
                                          drift=report.drift)

        client = RemoteEngineClient(
            session=self._session, server_url=request.server_url, rollout_id=rollout_id, tokenizer=tokenizer,
            model=request.tokenizer_name, tools=request.tools, sampling_params=request.sampling_params,
            policy=RetryPolicy(timeout_s=self.config.engine_timeout_s, retries=self.config.engine_retries,
                               backoff_s=self.config.engine_backoff_s),
            metrics=self.metrics, on_call=on_call)
        metadata = dict(request.metadata or {})
        ctx = RolloutContext(
            engine=client, tokenizer=tokenizer, sampling_params=dict(request.sampling_params), attempt=attempt,
            logger=logging.LoggerAdapter(log, {"rollout_id": rollout_id}), uid=rollout_id,
            instance_id=str(metadata.get("instance_id", rollout_id)), task_type=request.task_type,
            extra={"remote": True, "server_url": request.server_url, "metadata": metadata})
        # metadata keys (label, answer, ...) also sit at the top level, where task modules written for
        # input-file lines look for them; the protocol's own keys win.
        sample = {**metadata, "messages": snapshot(request.messages),
                  "tools": snapshot(request.tools) if request.tools else None,
                  "metadata": metadata, "rollout_id": rollout_id}
        module = self.registry.tasks[request.task_type].module
        limit = request.timeout_s or self.settings.rollout_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                result = await module.rollout(sample, ctx)
        except TimeoutError as exc:
            message = (f"rollout timed out after {limit:g}s" if deadline.expired()
                       else f"{type(exc).__name__}: {exc}")
            return self._error(request, message, client.conversation or conversation, client)
        except Exception as exc:  # noqa: BLE001 - any task failure becomes the ERROR callback
            log.info("rollout %s: task raised %s: %s", rollout_id, type(exc).__name__, exc)
            return self._error(request, f"{type(exc).__name__}: {exc}", client.conversation or conversation,
                               client)
        return self._completed(request, result, client)

    def _metadata(self, request: InitRequest, **info: Any) -> dict[str, Any]:
        return {**(request.metadata or {}), "rollout_buffer": info}

    def _error(self, request: InitRequest, error: str, messages: list[dict[str, Any]],
               client: RemoteEngineClient | None = None, *, calls: int = 0,
               mask: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ERROR body, with what is known of the calls made: from the `client`, else `calls` and `mask`."""
        if client is not None:
            calls, mask = client.calls, client.drift.as_dict()
        info: dict[str, Any] = {"engine_calls": calls}
        if mask is not None:
            info["mask"] = mask
        return callback_body(request.rollout_id, "ERROR", messages=snapshot(messages), reward=0.0, error=error,
                             metadata=self._metadata(request, **info))

    def _completed(self, request: InitRequest, result: Any, client: RemoteEngineClient) -> dict[str, Any]:
        if not isinstance(result, dict) or not isinstance(result.get("messages"), list):
            return self._error(request, f"task returned {type(result).__name__} without a messages list",
                               client.conversation, client)
        try:
            reward = float(result.get("reward", 0.0))
            messages = snapshot(result["messages"])
        except (TypeError, ValueError) as exc:
            return self._error(request, f"task result is not serialisable or has a bad reward: {exc}",
                               client.conversation, client)
        if not math.isfinite(reward):
            return self._error(request, f"task returned a non-finite reward {reward!r}", messages, client)
        info = {"task_status": result.get("status", "completed"), "extra_info": result.get("extra_info") or {},
                "engine_calls": client.calls, "turns": len(client.turns), "mask": client.drift.as_dict()}
        try:
            orjson.dumps(info)
        except TypeError:
            info["extra_info"] = {"unserialisable": True}
        return callback_body(request.rollout_id, "COMPLETED", messages=messages, reward=reward,
                             metadata=self._metadata(request, **info))

    async def _finish(self, request: InitRequest, body: dict[str, Any],
                      statuses: tuple[str, ...] = ("running",)) -> None:
        """Store the outcome with its callback body, then deliver it."""
        rollout_id = request.rollout_id
        status = "completed" if body["status"] == "COMPLETED" else "error"
        stored = await self.states.update(
            rollout_id, self.owner, statuses=statuses, status=status, finished_at=time.time(), callback=body,
            callback_status="pending", error=body.get("error", ""), reward=body["reward"])
        if not stored:
            log.warning("rollout %s: finished but no longer owned by this process; result dropped", rollout_id)
            return
        await self._deliver(rollout_id, request.server_url, body)

    async def _deliver(self, rollout_id: str, server_url: str, body: dict[str, Any]) -> None:
        assert self._sender is not None
        await self._sender.deliver(rollout_id, server_url, body)

    # ----- recovery -------------------------------------------------------------------------------

    async def scan_once(self) -> int:
        """Take over the unsettled rollouts of dead owners; returns how many were taken over."""
        taken = 0
        now = time.time()
        alive: dict[str, bool] = {self.owner: True}
        async for rollout_id, entered in self.states.open_ids():
            if rollout_id in self._active:
                continue
            brief = await self.states.brief(rollout_id)
            if brief is None:
                if now - entered > ORPHAN_INDEX_GRACE_S:  # index entry of a claim that never happened
                    await self.states.settle(rollout_id, self.config.settled_ttl_s)
                continue
            if brief["callback_status"] in SETTLED:  # settled, then crashed before leaving the open set
                await self.states.settle(rollout_id, self.config.settled_ttl_s)
                continue
            owner = brief["owner"]
            if owner not in alive:
                alive[owner] = await self.states.owner_alive(owner)
            if alive[owner]:
                continue
            if not await self.states.update(rollout_id, owner, new_owner=self.owner):
                continue  # another process took it first
            await self.states.incr(rollout_id, "takeovers")
            raw = await self.states.get(rollout_id)
            if raw is not None:
                taken += 1
                self._resume(rollout_id, raw)
        await self.states.prune_index(now - self.config.settled_ttl_s)
        return taken

    def _resume(self, rollout_id: str, raw: dict[str, str]) -> None:
        request = InitRequest.model_validate_json(raw["request"])
        status = raw.get("status")
        log.warning("rollout %s: taken over from a dead process in state %s", rollout_id, status)
        if status == "queued":
            self._start_rollout(rollout_id, request)
        elif status == "running":
            body = self._error(request, RESTARTED, request.messages, calls=int(raw.get("calls") or 0),
                               mask=public_view(raw)["mask"])
            self._spawn(self._finish(request, body), f"remote-finish-{rollout_id}")
        else:
            body = orjson.loads(raw["callback"])
            self._spawn(self._deliver(rollout_id, request.server_url, body), f"remote-deliver-{rollout_id}")
