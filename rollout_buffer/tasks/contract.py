"""The task-module contract: everything a `*_generator.py` module may define, in one place.

A task module is discovered by file name (`*_generator.py`) in `rollout_buffer/tasks/builtin/` and in every
`--task-dir`. It must define `TASK_TYPE: str` and one of:

* **native**: `async def rollout(sample: dict, ctx: RolloutContext) -> dict`. `sample` is one JSONL line
  of the run's `input_file`, normalised with slime's dataset keys (`input_key`, `label_key`,
  `metadata_key`, `tool_key` from `/start_rollout`; see `rollout_buffer.tasks.input_keys`): a copy of the line
  with `instance_id` (text), `prompt` (text or a list of chat messages), `label`, `metadata` (dict) and
  `tools` (list of tool schemas or None) set, every other key of the line kept as it is. The line as read
  is `ctx.line`. Return at least `{"messages": [...], "reward": float}`,
  optionally `status` (completed | truncated | aborted | failed) and `extra_info` (dict). Talk to the
  model only through `ctx.engine`, which records the token-exact `turns`. The runtime does the rest:
  repeats, epochs, concurrency, retries, timeouts, writing the record, failure records.
* **legacy (slime's)**: `def run_rollout(data: dict) -> None`, given the whole `/start_rollout` payload;
  it writes its own records to `{data["remote_buffer_url"]}/buffer/write`. It runs in a thread.

Optional group hooks, with slime's signatures (see `rollout_buffer.tasks.groups` for the defaults):

* `is_valid_group(group: tuple[str, list[dict]], min_valid_group_size: int, task_type: str) -> bool`
* `transform_group(group: tuple[str, list[dict]], task_type: str) -> tuple[str, list[dict]]`
* `get_group_data_meta_info(temp_data: dict[str, list[dict]]) -> dict`

Optional: `TOOLS: list[dict]` (OpenAI tool schemas the prompt is rendered with; `ctx.engine.chat` uses
them unless given `tools=`). Per-line tools (`sample["tools"]`) are the task's to pass: the built-in tasks
give them to `ctx.engine.chat(..., tools=...)`.

Optional: `reward(record: dict) -> float | dict`: the task's reward recomputed from a finished record alone
(its `messages`, `extra_info` with the label the rollout kept, `metadata`), without the engine: what
`rollout-buffer reverify` runs over a run's archive (docs/reverify.md). A dict gives `reward` and detail
kept with the new reward version. A native task should use it in `rollout` too, so the two cannot drift.

Helpers: `rollout_buffer.tasks.judge.Judge` (an LLM judge: `await judge.score(messages, label)` -> `{reward,
verdict, text, ...}`, raising `JudgeFailed` with `error_type` "judge_failed" after its retries, which the
runtime counts as that failure type) and `RemoteRM` (slime's remote reward model protocol), for a task's
`rollout` or `reward` (docs/judges.md).

Optional: `validate_sample(sample: dict) -> None`, given the normalised sample; raise (preferably
`InvalidSample(field, reason)`, naming the normalised field) when the task cannot use the line.
`/start_rollout` runs it on the first `VALIDATE_LINES` (100) lines of the input file before anything is
stored, and refuses the run with a 4xx naming the line number, the file's key and the reason. Lines after
those are checked when their rollout runs; one that fails becomes a `failed` record with
`error_type="InvalidSample"`.

Optional: `async def worker_start(server: ServerFacts) -> None`, awaited once by each worker process before it
takes any work (housekeeping: the agent task removes the sandboxes a dead worker of this host left); a
failure is logged, never fatal.

Optional: `validate_run(options: dict) -> None` (or `validate_run(options, server: ServerFacts)`), given the
`/start_rollout` body's extra fields and what the server allows; raise `InvalidSample(field, reason)` to
refuse the run with a 4xx naming the field (the task's own run options; `InvalidSample.status_code` may
raise it to 403 for what the server does not allow). `ctx.server` carries the same facts in a rollout.

What the runtime does for a native module (`rollout_buffer.runtime`):

* One task per (epoch, input line, repeat), enqueued up front on the run's Redis stream. The record's
  `uid` is `{run_id}:{epoch}:{instance_id}:{repeat}`, so a task done twice is stored once.
* It fills in `uid, instance_id, epoch, repeat, attempt, timestamp, duration_s`, `generation` (of the
  group: 1, 2, ... when a stale group is rolled out again, and then the uid ends in `@<generation>`),
  `policy_version` (the oldest version its engine calls were stamped with, see `rollout_buffer.wire.versions`),
  `turns` (from `ctx.engine.turns`), `tools`, `weight_version` (of the first engine call),
  `finish_reason` (of the last),
  and `status` when the task gives none: `truncated` if the last generation hit the token limit, `aborted`
  if it stayed aborted, else `completed`.
* An exception, an `EngineError` (after the client's retries), a `HistoryRewriteError`, a result without
  `messages`/`reward`, or the per-rollout time limit becomes a record with `status="failed"`,
  `reward=0.0`, `extra_info={"error": ..., "error_type": ...}` and no turns, so the group still completes.
  Failures are counted by `error_type` in `GET /runs/{run_id}` (`failures`: count and the first message of
  each type); the worker logs one line per new error type and periodic counts, not one line per rollout.

The engine client (`ctx.engine`) is chosen by the run's `engine_api` (`/start_rollout` field):
`"generate"` (default) talks token in / token out to SGLang `/generate` and records `turns`; `"chat"` talks
to `/v1/chat/completions` and records no turns. `ChatResult.finish_reason` is `stop`, `length` or `abort`
either way. Each call's history must extend the previous call's (append the returned message and the new
ones; never edit earlier messages), else `HistoryRewriteError`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollout_buffer.tasks.harbor_toml import TaskLimits


@dataclass
class ChatResult:
    """One model answer. `message` is an OpenAI-style assistant message ready to append to history:
    `{"role": "assistant", "content": str, "reasoning_content"?: str, "tool_calls"?: [...]}`."""

    message: dict[str, Any]
    finish_reason: str
    # {prompt_ids, output_ids, output_logprobs, finish_reason, weight_version[, version_spans]}
    turn: dict[str, Any] | None = None


@runtime_checkable
class EngineClient(Protocol):
    """What a task sees of the model. One client per rollout: it owns that rollout's token history.

    `chat` renders `messages` (+ `tools`) and samples one assistant message. The history is
    append-only: every call's `messages` must start with the previous call's messages plus the
    assistant message it returned; a rewrite raises `HistoryRewriteError`.
    """

    turns: list[dict[str, Any]]

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling_params: dict[str, Any] | None = None,
    ) -> ChatResult: ...


VALIDATE_LINES = 100


class InvalidSample(ValueError):
    """A line a task cannot use; `field` is the normalised field (`prompt`, `label`, `tools`, ...)."""

    status_code = 400  # a subclass for what the server does not allow (rather than a bad line) says 403

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


class HistoryRewriteError(RuntimeError):
    """A task changed messages that an earlier engine call already saw; no exact mask can follow."""


class EngineError(RuntimeError):
    """The engine failed after the client's retries (5xx, connection errors, malformed answers)."""


# `lock(name, hold_s)`: held for the `async with`, expiring after `hold_s`; TimeoutError when not had in time
HostLock = Callable[[str, float], AbstractAsyncContextManager[None]]


class ImageCache(Protocol):
    """The task images the buffer pulled or built into each Engine, by last use (from the runtime: Redis), and
    the host's disk budget for them (`--image-cache-mb`): past it the least recently used go."""

    budget_bytes: int
    grace_s: float  # an image asked for this recently may be about to get its container: never removed

    async def used(self, engine: str, image: str, *, add: bool = True) -> None:
        """Its last use is now (`add=False`: only if it is recorded already)."""
        ...

    async def by_age(self, engine: str) -> list[tuple[str, float]]:
        """(image, unix time of its last use), least recently used first."""
        ...

    async def forget(self, engine: str, image: str) -> None: ...


@dataclass(frozen=True)
class ServerFacts:
    """What the server (or the worker) running a task allows: its `--agent-sandbox` backends."""

    agent_sandboxes: tuple[str, ...] = ()
    input_roots: tuple[str, ...] = ()  # `--input-root`: the only host folders a run may mount into a sandbox
    allowed_urls: tuple[str, ...] = ()  # `--allow-url`: prefixes a judge's or reward model's URL must match
    # hosts each sandbox phase may reach through its egress proxy, and the upstream proxy that dials
    egress_agent: tuple[str, ...] = ()
    egress_verifier: tuple[str, ...] = ()
    egress_proxy: str = ""
    egress_mirror: tuple[str, ...] = ()  # `--egress-mirror`: `host=addr:port`, allowed hosts served by a mirror
    egress_build: tuple[str, ...] = ()  # `--egress-build`: hosts a Harbor task's image build may reach
    forwarder_image: str = ""  # `--forwarder-image`: the docker sandboxes' default `forwarder_image` option
    # `host_lock(name, hold_s)`: an async context manager held across every worker process and host (a lock in
    # Redis, from the runtime), so an image is pulled or built once per Engine; None: this process's locks only
    host_lock: HostLock | None = field(default=None, compare=False)
    # `--gateway-url`: how this host reaches the gateway (sandbox relays, in-process agents); "" = the run's
    # remote_buffer_url, the address /start_rollout arrived on
    gateway_url: str = ""
    model_body_bytes: int | None = None  # the gateway's body cap on the model routes, which sandbox relays apply
    task_limits: TaskLimits | None = None  # the largest cpus, memory, storage and timeouts a Harbor task may ask
    # the Engine's bounded cache of task images (`--image-cache-mb`); None: unbounded (nothing is removed)
    image_cache: ImageCache | None = field(default=None, compare=False)

    @property
    def egress(self) -> dict[str, tuple[str, ...]]:
        """Phase -> the hosts the operator lets it reach (`--egress-agent`, `--egress-verifier`)."""
        return {"agent": self.egress_agent, "verifier": self.egress_verifier}


@dataclass
class RolloutContext:
    """What the runtime hands a native `rollout(sample, ctx)`."""

    engine: EngineClient
    tokenizer: Any | None
    sampling_params: dict[str, Any]
    attempt: int
    logger: logging.Logger | logging.LoggerAdapter
    run_id: str = ""
    uid: str = ""
    instance_id: str = ""
    epoch: int = 0
    repeat: int = 0
    task_type: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    line: dict[str, Any] = field(default_factory=dict)  # the input line as read, before the key mapping
    server: ServerFacts = field(default_factory=ServerFacts)
    # opens this rollout's agent gateway session (`session()`); set by the runtime
    session_opener: Callable[[], Awaitable[dict[str, Any]]] | None = None

    async def session(self) -> dict[str, Any]:
        """This rollout's agent gateway session, for an agent in this process that speaks OpenAI or Anthropic:
        `{session_id, api_key, openai_base_url, anthropic_base_url}` (the same on every call). Its turns become
        the rollout's record's `turns`, token-exact, as `ctx.engine`'s would."""
        if self.session_opener is None:
            raise RuntimeError("this rollout has no agent gateway session (the runtime did not provide one)")
        return await self.session_opener()
