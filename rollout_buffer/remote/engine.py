"""The engine client of a remote rollout: the trainer's own `/v1/chat/completions`, with `response_mask`.

Each call sends `rollout_id`, the full `messages`, `tools`, the sampling params (OpenAI names, top level),
`return_token_ids: true` and `call_index`; every call after the first also sends `response_mask`, the
zeros for the tokens the history gained that the model did not sample (see `remote.mask`). A retried call
repeats its `call_index` and `Idempotency-Key: <rollout_id>:<call_index>`, so a trainer can tell a retry
from a new turn. Implements `task_contract.EngineClient`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from rollout_buffer.remote.mask import ResponseMaskTracker
from rollout_buffer.runtime.chat_client import parse_chat_answer
from rollout_buffer.runtime.engine_http import (
    RetryPolicy,
    TransientEngineError,
    call_with_retries,
    post_once,
)
from rollout_buffer.runtime.history import HistoryGuard, snapshot
from rollout_buffer.task_contract import ChatResult, HistoryRewriteError

log = logging.getLogger(__name__)
CLOSED_FINISH_REASONS = ("stop",)


def openai_params(defaults: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """The /init's sampling params with a call's overrides on top; SGLang's `max_new_tokens` becomes
    OpenAI's `max_tokens`."""
    params = {**defaults, **(override or {})}
    if "max_new_tokens" in params:
        value = params.pop("max_new_tokens")
        params.setdefault("max_tokens", value)
    return params


def token_ids_of(answer: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None] | None:
    """(prompt ids, output ids, output logprobs) when the server returned token ids (vLLM / SGLang style)."""
    choice = (answer.get("choices") or [{}])[0]
    prompt = answer.get("prompt_token_ids", choice.get("prompt_token_ids"))
    output = choice.get("token_ids")
    if not isinstance(prompt, list) or not isinstance(output, list):
        return None
    content = choice["logprobs"].get("content") if isinstance(choice.get("logprobs"), dict) else None
    try:
        logprobs = [float(entry["logprob"]) for entry in content] if isinstance(content, list) else None
    except (KeyError, TypeError, ValueError):
        logprobs = None
    if logprobs is not None and len(logprobs) != len(output):
        logprobs = None
    return [int(x) for x in prompt], [int(x) for x in output], logprobs


class RemoteEngineClient:
    """One remote rollout's view of the trainer-hosted model."""

    def __init__(self, *, session: aiohttp.ClientSession, server_url: str, rollout_id: str, tokenizer: Any,
                 model: str, tools: list[dict[str, Any]] | None, sampling_params: dict[str, Any],
                 policy: RetryPolicy, on_call: Callable[[dict[str, Any] | None], Awaitable[None]] | None = None) -> None:
        self.session = session
        self.url = f"{server_url.rstrip('/')}/v1/chat/completions"
        self.rollout_id = rollout_id
        self.model = model
        self.default_tools = tools or None
        self.sampling_params = dict(sampling_params)
        self.policy = policy
        self.on_call = on_call
        self.tracker = ResponseMaskTracker(tokenizer)
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

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   sampling_params: dict[str, Any] | None = None) -> ChatResult:
        tools = tools if tools is not None else self.default_tools
        explicit, self._explicit_mask = self._explicit_mask, None
        if explicit is None:
            self.guard.new_messages(messages, tools)  # raises HistoryRewriteError on a rewrite
        elif not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages")
        prompt = self.tracker.render(messages, tools)
        if explicit is not None:
            mask: list[int] | None = explicit
        elif self.calls == 0:
            mask = None
        else:
            mask = [0] * self.tracker.new_tokens(prompt)
        body: dict[str, Any] = {"model": self.model, "rollout_id": self.rollout_id, "messages": snapshot(messages),
                                **openai_params(self.sampling_params, sampling_params),
                                "return_token_ids": True, "call_index": self.calls}
        if tools:
            body["tools"] = tools
        if mask is not None:
            body["response_mask"] = mask
        answer = await self._post(body)
        message, finish, _ = parse_chat_answer(answer)
        if finish == "tool_calls":  # OpenAI's name for a turn that ended normally with a call; SGLang says stop
            finish = "stop"
        ids = token_ids_of(answer)
        turn: dict[str, Any] | None = None
        if ids is not None:
            prompt_ids, output_ids, logprobs = ids
            turn = {"prompt_ids": prompt_ids, "output_ids": output_ids, "output_logprobs": logprobs or [],
                    "finish_reason": finish, "weight_version": (answer.get("metadata") or {}).get("weight_version")}
            self.turns.append(turn)
            closed = bool(output_ids) and output_ids[-1] == self.tracker.eot
        else:
            closed = finish in CLOSED_FINISH_REASONS
        self.tracker.commit(prompt, closed)
        self.guard.record(messages, tools, message)
        self.masks_sent.append(mask)
        self.calls += 1
        if self.on_call is not None:
            await self.on_call(turn)
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


__all__ = ["HistoryRewriteError", "RemoteEngineClient", "openai_params", "token_ids_of"]
