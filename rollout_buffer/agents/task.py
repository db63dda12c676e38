"""The `agent_command` rollout: run an unmodified agent command on one problem in a fresh sandbox, score
it with the run's verifier, and hand the session's token-exact turns to the record.

Each rollout: open its gateway session (`ctx.session()`), open a sandbox, write the run's files (an agent's
config) and the line's files, run the setup, run the agent command with the session's variables, run the
verifier, clean the sandbox up (always, also on cancel and at the runtime's deadline). The record carries
the reward, and in `extra_info["agent"]` the agent's exit status, duration and bounded stdout/stderr tails.
Failures are records with `status="failed"` and an `error_type`, counted per type in `GET /runs/{id}` and
`/metrics` like any task's: `agent_timeout`, `agent_exit` (non-zero exit), `container_killed` (the agent ended its
container from inside), `disk_limit` (the
agent's files passed the sandbox's `disk_mb`, a Harbor task's `storage_mb`: it was stopped), `setup_failed`,
`verifier_error`. A Harbor task (a sample with `harbor`, read from a task folder) runs in its own image with
its own limits and its tests/test.sh as the verifier (`rollout_buffer.agents.harbor`), in the container the
run's `agent.verify` mode gives (`rollout_buffer.agents.verify`); once test.sh has started, a failure is kept:
`verifier_timeout`, `verifier_killed`, `reward_missing`, `reward_invalid`. Every failure record carries the
run's failure reward (`agent.verify.failure_reward`, default 0) and stays in its group. An infrastructure
failure (`SandboxError`: the sandbox could not be made, a command could not be started, the verifier's
container could not be made or filled) is retried once with a new sandbox; an agent's own failure never is.
One that persists is `sandbox_error`, marked `extra_info["infrastructure"]`: never a reward, its group is
dropped at hand-over and counted (`rollout_buffer.runs.reads`).
One whose sandbox could not be created because the Engine itself failed (unreachable, a server error) is also
marked `extra_info["engine_failure"]`: the runtime returns it for another host and pauses a host whose Engine
keeps failing (`rollout_buffer.runtime.host_health`).

The line's `metadata` (a Harbor task's `[metadata]`) is the record's `extra_info["metadata"]`.

The agent's key is model-only (its session belongs to the rollout: it cannot finish it; the reward is the
verifier's). In an isolating sandbox (bwrap, docker) the agent's base URL is the sandbox's own loopback,
relayed to this session's model endpoints only (`model_relay.py`).

A task module reuses this with its own steps: `rollout = make_rollout(prepare=..., command=..., verify=...)`
(see `make_rollout`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollout_buffer.agents.config import AgentConfig, AgentConfigError, fill, parse
from rollout_buffer.agents.egress import EgressProxy, Mirrors
from rollout_buffer.agents.harbor.network import phase_allowlist, proxy_env
from rollout_buffer.agents.harbor.build_net import BuildEgress
from rollout_buffer.agents.harbor.plan import harbor_config, harbor_options
from rollout_buffer.agents.model_relay import RelayLimits
from rollout_buffer.agents.pool import Prepared, SandboxPool, prepare
from rollout_buffer.agents.sandbox import Sandbox, SandboxError
from rollout_buffer.agents.verifiers import AgentResult, VerifierError, as_verifier, final_text, run_verifier
from rollout_buffer.agents.verify.keep import WORK_FOLDER
from rollout_buffer.agents.verify.reward import KeptFailure
from rollout_buffer.tasks import host_events
from rollout_buffer.tasks.contract import InvalidSample, RolloutContext, ServerFacts
from rollout_buffer.wire.timeline import span

TASK_TYPE = "agent_command"
Prepare = Callable[[Sandbox, dict[str, Any], dict[str, str], AgentConfig], Awaitable[None]]
Command = Callable[[dict[str, Any], dict[str, str], AgentConfig], list[str]]
INFRASTRUCTURE_ERROR = "sandbox_error"
_configs: dict[str, AgentConfig] = {}
MAX_CACHED_CONFIGS = 64
_slots: dict[str, asyncio.Semaphore] = {}
_pools: dict[str, SandboxPool] = {}


class StepFailed(Exception):
    """A rollout step failed in a way that is the task's or the agent's, not the infrastructure's."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def config_of(options: dict[str, Any], server: ServerFacts) -> AgentConfig:
    key = json.dumps([options.get("agent"), server.agent_sandboxes, server.input_roots], sort_keys=True, default=str)
    if key not in _configs:
        if len(_configs) >= MAX_CACHED_CONFIGS:  # one per run's options: the oldest go first
            del _configs[next(iter(_configs))]
        _configs[key] = parse(options, server)
    return _configs[key]


async def worker_start(server: ServerFacts) -> None:
    """Before this worker process takes work: remove the docker sandboxes a dead worker of this host left (a
    host that comes back after it was lost starts clean)."""
    if "docker" in server.agent_sandboxes:
        from rollout_buffer.agents.docker_engine import sweep_once

        await sweep_once({})


def validate_run(options: dict[str, Any], server: ServerFacts) -> None:
    """Refuse a run whose `agent` options are wrong, or that this server does not allow (403: agent commands
    off, a backend not enabled), at /start_rollout, before anything is stored; the backend checks its options
    too (docker: the image exists)."""
    parse(options, server, check_backend=True)


def validate_sample(sample: dict[str, Any]) -> None:
    prompt_text(sample)
    files = sample.get("files")
    if files is not None and (not isinstance(files, dict)
                              or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        raise InvalidSample("files", "must be an object of path: text")
    if sample.get("setup") is not None and not isinstance(sample["setup"], str):
        raise InvalidSample("setup", "must be a shell command line")
    if sample.get("image") is not None and (not isinstance(sample["image"], str) or not sample["image"]):
        raise InvalidSample("image", "must be the name of a container image (the docker backend's image)")


def prompt_text(sample: dict[str, Any]) -> str:
    """The problem as the agent's prompt: the text, or the last user message's text."""
    prompt = sample.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return prompt
    if isinstance(prompt, list):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
                return message["content"]
    raise InvalidSample("prompt", "must be a non-empty text (or chat messages ending in a user message)")


async def default_prepare(sandbox: Sandbox, sample: dict[str, Any], values: dict[str, str],
                          config: AgentConfig) -> None:
    """The run's files (templates filled), the line's files, then the line's or the run's setup command."""
    for path, template in config.files.items():
        await sandbox.write_file(fill(path, values), fill(template, values))
    for path, text in (sample.get("files") or {}).items():
        await sandbox.write_file(path, text)
    setup = sample.get("setup") or config.setup
    if setup:
        run = await sandbox.exec(["bash", "-c", setup], timeout_s=config.setup_timeout_s)
        if not run.ok:
            raise StepFailed("setup_failed", f"setup exited {run.exit_code} (timed out: {run.timed_out}); "
                                             f"stderr tail: {run.stderr[-1000:]}")


def default_command(sample: dict[str, Any], values: dict[str, str], config: AgentConfig) -> list[str]:
    return config.argv(values)


def make_rollout(*, prepare: Prepare | None = None, command: Command | None = None,
                 verify: Callable[..., Any] | None = None) -> Callable[[dict[str, Any], RolloutContext], Any]:
    """An agent_command `rollout(sample, ctx)` with any step replaced: `prepare(sandbox, sample, values,
    config)` (async), `command(sample, values, config) -> argv`, `verify(sandbox, sample, agent_result) ->
    float | dict` (sync or async; replaces the run's verifier)."""
    steps = {"prepare": prepare or default_prepare, "command": command or default_command,
             "verify": as_verifier(verify) if verify is not None else None}

    async def rollout(sample: dict[str, Any], ctx: RolloutContext) -> dict[str, Any]:
        try:
            config = config_of(ctx.extra.get("options") or {}, ctx.server)
        except AgentConfigError as exc:  # e.g. a worker that does not enable the run's backend
            return _failed(sample, "agent_config", f"{exc.field}: {exc.reason}", {})
        if sample.get("harbor"):  # a Harbor task folder: its image, limits, timeout and test-script verifier
            try:
                config = harbor_config(config, sample, ctx.server.egress, ctx.server.egress_proxy,
                                       ctx.server.egress_mirror, _work_store(ctx))
            except AgentConfigError as exc:
                return _failed(sample, "agent_config", f"{exc.field}: {exc.reason}", {})
        slot = _slot(ctx.run_id, config.max_concurrent_agents)
        async with slot:
            return await _run(sample, ctx, config, steps)

    return rollout


def _work_store(ctx: RolloutContext) -> Path | None:
    """Where `agent.verify.keep_work` keeps work products: the run's archive folder's (none: not kept)."""
    folder = ctx.extra.get("archive_dir")
    return Path(folder) / WORK_FOLDER if folder else None


def release_run(run_id: str) -> None:
    """The run's rollouts are over in this process: drop its concurrency slots (the worker calls this)."""
    _slots.pop(run_id, None)


def _slot(run_id: str, limit: int | None) -> Any:
    if limit is None:
        return _Unbounded()
    if run_id not in _slots:
        _slots[run_id] = asyncio.Semaphore(limit)
    return _slots[run_id]


class _Unbounded:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: Any) -> None:
        return None


async def _run(sample: dict[str, Any], ctx: RolloutContext, config: AgentConfig,
               steps: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    session = await ctx.session()
    prompt = prompt_text(sample)
    info: dict[str, Any] = {"session_id": session["session_id"]}
    if isinstance(sample.get("metadata"), dict) and sample["metadata"]:  # the line's (a Harbor task's [metadata])
        info["metadata"] = sample["metadata"]
    for attempt in (1, 2):
        prepared: Prepared | None = None
        creating = True  # a failure now is the sandbox's creation (an Engine failure then counts for its host)
        try:
            with span("sandbox_create", backend=config.backend, attempt=attempt):
                host_events.note("sandbox_starting", 1)
                try:
                    prepared = await _sandbox(ctx, config, session, sample)
                finally:
                    host_events.note("sandbox_starting", -1)
            host_events.note("sandbox_running", 1)
            creating = False
            sandbox = prepared.sandbox
            workdir, home = _places(sandbox)
            base = prepared.model_url or session["anthropic_base_url"]
            values = {"prompt": prompt, "instance_id": str(sample["instance_id"]), "session_id": session["session_id"],
                      "api_key": session["api_key"], "openai_base_url": f"{base}/v1",
                      "anthropic_base_url": base, "workdir": workdir, "home": home}
            with span("sandbox_exec", step="prepare"):
                await steps["prepare"](sandbox, sample, values, config)
            argv = steps["command"](sample, values, config)
            egress_url = getattr(sandbox, "egress_url", None) if prepared.egress is not None else None
            with span("agent", session=session["session_id"]) as noted:
                run = await sandbox.exec(argv, timeout_s=config.timeout_s,
                                         env={**config.environment(values), **proxy_env(egress_url)})
                noted.update(exit_code=run.exit_code, timed_out=run.timed_out)
            agent = AgentResult(exit_code=run.exit_code, stdout=run.stdout, stderr=run.stderr, timed_out=run.timed_out,
                                duration_s=run.duration_s, final_text=final_text(run.stdout), extra=run.extra)
            info["agent"] = _agent_info(agent, run.output_bytes, config.output_tail_chars)
            if agent.extra.get("stopped_by") == "disk_mb":
                limit = "storage_mb" if sample.get("harbor") else "disk_mb"
                raise StepFailed("disk_limit", f"the agent wrote past its {limit}={config.limits.disk_mb} MB and "
                                               f"was stopped{_tails(agent)}")
            if agent.timed_out:
                killed = ("killed with its process tree" if agent.extra.get("killed", True) else
                          "stopped, but its process tree could not be shown to be gone (guard lost)")
                raise StepFailed("agent_timeout", f"the agent ran past its {config.timeout_s:g}s budget and was "
                                                  f"{killed}{_tails(agent)}")
            if agent.extra.get("container_died_inside"):  # the agent ended its own container: its failure, kept
                raise StepFailed("container_killed", f"the agent's container died of what ran in it (its main "
                                                     f"process killed, or its memory exhausted){_tails(agent)}")
            if _container_gone(agent):
                raise SandboxError("the sandbox's container went away while the agent ran (not the agent's doing: "
                                   "the Engine's API killed or removed it)")
            if agent.exit_code != 0:
                raise StepFailed("agent_exit", f"the agent exited {agent.exit_code}{_tails(agent)}")
            try:
                with span("verifier") as noted:
                    verdict = await run_verifier(steps["verify"] or config.verifier, sandbox, sample, agent)
                    noted["reward"] = verdict["reward"]
            except KeptFailure as exc:  # test.sh started and gave no valid reward: the agent's, kept
                info["verifier"] = exc.details
                raise StepFailed(exc.error_type, str(exc)) from exc
            except VerifierError as exc:
                if sample.get("harbor") or exc.infrastructure:  # no verdict at all: never trained on as a zero
                    info["infrastructure"] = True
                raise StepFailed(exc.error_type, str(exc)) from exc
            bounds = config.verify.reward_range  # a run's own range holds for its own verifiers too
            if bounds and not sample.get("harbor") and not bounds[0] <= verdict["reward"] <= bounds[1]:
                raise StepFailed("reward_invalid", f"the reward {verdict['reward']!r} is outside the run's "
                                                   f"agent.verify.reward_range {list(bounds)}")
        except SandboxError as exc:
            engine_down = creating and exc.engine_failure
            if engine_down:
                host_events.note("create_failures")
            if attempt == 2:  # not the agent's doing: never a reward; its group is dropped, counted
                info.update(duration_s=round(time.monotonic() - started, 3), infrastructure=True)
                if engine_down:  # the host's Engine: the runtime returns the rollout for another host
                    info["engine_failure"] = True
                return _failed(sample, INFRASTRUCTURE_ERROR, f"the sandbox failed twice: {exc}", info)
            info["infra_retries"] = 1
            ctx.logger.warning("sandbox failure, retrying once with a new sandbox: %s", exc)
            continue
        except StepFailed as exc:
            info["duration_s"] = round(time.monotonic() - started, 3)
            return _failed(sample, exc.error_type, str(exc), info, final=info.get("agent", {}).get("final_text", ""),
                           reward=config.verify.failure_reward)
        finally:
            if prepared is not None:
                if prepared.relay is not None and prepared.relay.counts:  # what the relay refused or dropped
                    info["relay_drops"] = dict(prepared.relay.counts)
                with span("sandbox_remove"):
                    await prepared.release()
                host_events.note("sandbox_running", -1)
        info["verifier"] = {k: v for k, v in verdict.items() if k != "reward"}
        info["duration_s"] = round(time.monotonic() - started, 3)
        return {"messages": _messages(prompt, agent.final_text), "reward": verdict["reward"], "extra_info": info}
    raise AssertionError("unreachable")


async def _sandbox(ctx: RolloutContext, config: AgentConfig, session: dict[str, Any],
                   sample: dict[str, Any]) -> Prepared:
    """A sandbox for this rollout (from the run's pool when it keeps one), its relay keyed to this session. A
    line's own `image` (docker) replaces the run's and is never pooled."""
    upstream = session["anthropic_base_url"]
    options = dict(config.sandbox_options)
    if config.backend == "docker" and ctx.server.forwarder_image:  # `--forwarder-image`: the run's own option wins
        options.setdefault("forwarder_image", ctx.server.forwarder_image)
    if sample.get("image"):
        options["image"] = sample["image"]
    egress = None
    if sample.get("harbor"):
        options = await harbor_options(sample, options, ctx.server.host_lock, ctx.server.image_cache,
                                       BuildEgress.of(ctx.server))
        allow = phase_allowlist(sample["harbor"], "agent", ctx.server.egress)
        if allow is not None and allow.entries:  # the operator grants the agent hosts, and the task wants them
            egress = await EgressProxy(allow, upstream=ctx.server.egress_proxy or None,
                                       mirrors=Mirrors.parse(ctx.server.egress_mirror)).start()
            options["egress_socket"] = egress.socket_path

    relay_limits = RelayLimits(max_body_bytes=ctx.server.model_body_bytes) if ctx.server.model_body_bytes else None

    def make() -> Any:
        return prepare(config.backend, name=f"{ctx.run_id}-{sample['instance_id']}", limits=config.limits,
                       options=options, upstream=upstream, relay_limits=relay_limits)

    if config.pool and not sample.get("image") and not sample.get("harbor"):
        key = json.dumps([ctx.run_id, config.raw], sort_keys=True, default=str)
        if key not in _pools:
            _pools[key] = SandboxPool(config.pool, make, lambda: _pools.pop(key, None))
        prepared = await _pools[key].take()
    else:
        try:
            prepared = await make()
        except BaseException:
            if egress is not None:
                await egress.close()
            raise
    if egress is not None:
        egress.admit(getattr(prepared.sandbox, "model_peer_uid", None))
        prepared.egress = egress
    if prepared.relay is not None:
        prepared.relay.api_key = session["api_key"]
    return prepared


def _container_gone(agent: AgentResult) -> bool:
    """A docker sandbox whose container went away though the buffer did not remove it, by the Engine's API (an
    Engine restart, another process's sweep): never the agent's failure (`docker_watch` tells it from a death
    inside the container, which is)."""
    return bool(agent.extra.get("container_vanished"))


def _places(sandbox: Sandbox) -> tuple[str, str]:
    work, home = getattr(sandbox, "work", ""), getattr(sandbox, "home", "")
    return str(work), str(home)


def _agent_info(agent: AgentResult, output_bytes: int, tail: int) -> dict[str, Any]:
    return {"exit_code": agent.exit_code, "timed_out": agent.timed_out, "duration_s": agent.duration_s,
            "output_bytes": output_bytes, "stdout_tail": agent.stdout[-tail:] if tail else "",
            "stderr_tail": agent.stderr[-tail:] if tail else "", "final_text": agent.final_text[-tail:] if tail else "",
            **agent.extra}


def _tails(agent: AgentResult) -> str:
    return f"; stdout tail: {agent.stdout[-600:]!r}; stderr tail: {agent.stderr[-600:]!r}"


def _messages(prompt: str, answer: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _failed(sample: dict[str, Any], error_type: str, message: str, info: dict[str, Any],
            final: str = "", reward: float = 0.0) -> dict[str, Any]:
    try:
        prompt = prompt_text(sample)
    except InvalidSample:
        prompt = ""
    return {"messages": _messages(prompt, final), "reward": reward, "status": "failed",
            "extra_info": {**info, "error": message, "error_type": error_type}}


rollout = make_rollout()
