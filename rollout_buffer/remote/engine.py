"""The engine client of a remote rollout: the trainer's own `/v1/chat/completions`, with `response_mask`.

Each call sends `rollout_id`, the full `messages`, `tools`, the sampling params (OpenAI names, top level),
`return_token_ids: true` and `call_index`; every call after the first also sends `response_mask`, the
zeros for the tokens the history gained that the model did not sample, counted by the protocol's formula on
this very body (see `remote.mask`). A retried call repeats its body, `call_index` included, under
`Idempotency-Key: <rollout_id>:<call_index>`, so a trainer can tell a retry from a new turn. Implements
`task_contract.EngineClient`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollout_buffer.remote.drift import Drift, DriftTally
from rollout_buffer.remote.mask import MaskCountError, ResponseMaskCounter
from rollout_buffer.remote.metrics import RemoteMetrics
from rollout_buffer.runtime.chat_client import parse_chat_answer
from rollout_buffer.runtime.engine_http import RetryPolicy, TransientEngineError, call_with_retries, post_once
from rollout_buffer.runtime.history import HistoryGuard, snapshot
from rollout_buffer.tasks.contract import ChatResult, HistoryRewriteError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallReport:
    """What one finished call adds to the rollout's state."""

    turn: dict[str, Any] | None  # the token-exact turn, when the answer carried prompt and output token ids
    counted: bool  # the call carried a response_mask counted by the formula
    drift: Drift | None


def openai_params(defaults: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """The /init's sampling params with a call's overrides on top; SGLang's `max_new_tokens` becomes
    OpenAI's `max_tokens`."""
    params = {**defaults, **(override or {})}
    if "max_new_tokens" in params:
        value = params.pop("max_new_tokens")
        params.setdefault("max_tokens", value)
    return params


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    try:
        return [int(x) for x in value]
    except (TypeError, ValueError):
        return None


def token_ids_of(answer: dict[str, Any]) -> tuple[list[int] | None, list[int], list[float] | None] | None:
    """(prompt ids or None, output ids, output logprobs) when the answer carries the completion's token ids:
    on the choice (vLLM / SGLang `return_token_ids`) or at the top level (the remote-rollout guide's shape)."""
    choice = (answer.get("choices") or [{}])[0]
    output = _int_list(choice.get("token_ids", answer.get("token_ids")))
    if output is None:
        return None
    prompt = _int_list(answer.get("prompt_token_ids", choice.get("prompt_token_ids")))
    content = choice["logprobs"].get("content") if isinstance(choice.get("logprobs"), dict) else None
    try:
        logprobs = [float(entry["logprob"]) for entry in content] if isinstance(content, list) else None
    except (KeyError, TypeError, ValueError):
        logprobs = None
    if logprobs is not None and len(logprobs) != len(output):
        logprobs = None
    return prompt, output, logprobs


class RemoteEngineClient:
    """One remote rollout's view of the trainer-hosted model."""

    def __init__(self, *, session: aiohttp.ClientSession, server_url: str, rollout_id: str, tokenizer: Any,
                 model: str, tools: list[dict[str, Any]] | None, sampling_params: dict[str, Any],
                 policy: RetryPolicy, metrics: RemoteMetrics | None = None,
                 on_call: Callable[[CallReport], Awaitable[None]] | None = None) -> None:
        self.session = session
        self.url = f"{server_url.rstrip('/')}/v1/chat/completions"
        self.rollout_id = rollout_id
        self.model = model
        self.default_tools = tools or None
        self.sampling_params = dict(sampling_params)
        self.policy = policy
        self.metrics = metrics
        self.on_call = on_call
        self.counter = ResponseMaskCounter(tokenizer)
        self.drift = DriftTally()
        self.guard = HistoryGuard()
        self.turns: list[dict[str, Any]] = []
        self.calls = 0
        self.masks_sent: list[list[int] | None] = []
        self._explicit_mask: list[int] | None = None

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """Everything the trainer has seen so far, for the ERROR callback."""
        return self.guard.conversation()

    def set_next_response_mask(self, mask: list[int]) -> None:
        """Send `mask` verbatim with the next call instead of counting it.

        For tasks that must rewrite history (truncate, summarise): the append-only check is skipped for
        that one call, the task takes responsibility for the mask, and counting resumes from that call's
        prompt. Entries must be 0 (not the model's) or 1."""
        if not isinstance(mask, list) or not all(isinstance(x, int) and x in (0, 1) for x in mask):
            raise ValueError("response_mask must be a list of 0/1 integers")
        if self.calls == 0:
            raise ValueError("the first call carries no response_mask")
        self._explicit_mask = list(mask)

    def _mask(self, prompt: list[int], explicit: list[int] | None) -> tuple[list[int] | None, Drift | None]:
        """The call's response_mask (None on the first call) and its drift; counted unless `explicit`."""
        if explicit is not None:
            return explicit, None
        if self.calls == 0:
            return None, None
        try:
            n, drift = self.counter.count(prompt, self.calls)
        except MaskCountError as exc:
            if self.metrics is not None:
                self.metrics.refusal(exc.reason)
            raise
        return [0] * n, drift

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   sampling_params: dict[str, Any] | None = None) -> ChatResult:
        tools = tools if tools is not None else self.default_tools
        explicit, self._explicit_mask = self._explicit_mask, None
        if explicit is None:
            self.guard.new_messages(messages, tools)  # raises HistoryRewriteError on a rewrite
        elif not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages")
        body: dict[str, Any] = {"model": self.model, "rollout_id": self.rollout_id, "messages": snapshot(messages),
                                **openai_params(self.sampling_params, sampling_params),
                                "return_token_ids": True, "call_index": self.calls}
        if tools:
            body["tools"] = snapshot(tools)
        prompt = self.counter.render(body["messages"], body.get("tools"))  # exactly what is sent
        mask, drift = self._mask(prompt, explicit)
        if mask is not None:
            body["response_mask"] = mask
        answer = await self._post(body)
        message, finish, _ = parse_chat_answer(answer)
        if finish == "tool_calls":  # OpenAI's name for a turn that ended normally with a call; SGLang says stop
            finish = "stop"
        ids = token_ids_of(answer)
        turn: dict[str, Any] | None = None
        output_ids: list[int] | None = None
        if ids is not None:
            prompt_ids, output_ids, logprobs = ids
            if prompt_ids is not None:  # a turn is token-exact only with the trainer's own prompt ids
                turn = {"prompt_ids": prompt_ids, "output_ids": output_ids, "output_logprobs": logprobs or [],
                        "finish_reason": finish, "weight_version": (answer.get("metadata") or {}).get("weight_version")}
                self.turns.append(turn)
        counted = mask is not None and explicit is None
        if counted:
            self.drift.add(drift)
            if self.metrics is not None:
                self.metrics.counted(drift)
        self.counter.commit(prompt, output_ids)
        self.guard.record(messages, tools, message)
        self.masks_sent.append(mask)
        self.calls += 1
        if self.on_call is not None:
            await self.on_call(CallReport(turn=turn, counted=counted, drift=drift))
        return ChatResult(message=message, finish_reason=finish, turn=turn)

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Idempotency-Key": f"{self.rollout_id}:{body['call_index']}"}

        async def attempt(number: int) -> dict[str, Any]:
            answer = await post_once(self.session, self.url, body, headers=headers, timeout_s=self.policy.timeout_s)
            if not isinstance(answer.get("choices"), list) or not answer["choices"]:
                raise TransientEngineError(f"{self.url} answered without choices")
            return answer

        def on_retry(error: BaseException) -> None:
            log.debug("rollout %s: retrying trainer call %s: %s", self.rollout_id, body["call_index"], error)

        return await call_with_retries(attempt, self.policy, on_retry=on_retry)


__all__ = ["CallReport", "HistoryRewriteError", "MaskCountError", "RemoteEngineClient", "openai_params",
           "token_ids_of"]
