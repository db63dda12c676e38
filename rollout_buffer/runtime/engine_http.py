"""HTTP to the engine: one pooled aiohttp session per worker process, bounded retries with backoff.

Transient failures (5xx, 429, connection errors, timeouts, answers that are not the JSON we expect) are
retried with exponential backoff and jitter (tenacity), a bounded number of times; a 4xx is the caller's
mistake and fails at once. Either way the caller sees one `EngineError` naming the last cause. The first
attempt runs bare: the retry machinery is only set up once a call has failed, so the common path (every
engine call) pays nothing for it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from rollout_buffer.tasks.contract import EngineError

log = logging.getLogger(__name__)


class TransientEngineError(EngineError):
    """A failure worth retrying; becomes a plain EngineError when the retries run out."""


class EngineTimeout(TransientEngineError):
    """No answer in time: the request may still be running in the engine, so the caller may abort it."""


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float = 600.0
    retries: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0


def new_session() -> aiohttp.ClientSession:
    """The worker process's pooled session: no per-host cap, so `num_process` rollouts really run at once."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, json_serialize=lambda v: orjson.dumps(v).decode())


async def close_session(session: aiohttp.ClientSession) -> None:
    """Close a session from `new_session`."""
    await session.close()


async def post_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
                    headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """One POST; classifies every failure as transient or final."""
    payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)  # token ids may come as a numpy array
    try:
        async with session.post(url, data=payload, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                headers={"Content-Type": "application/json", **headers}) as response:
            raw = await response.read()
            status = response.status
    except TimeoutError as exc:
        raise EngineTimeout(f"no answer from {url} within {timeout_s:g}s") from exc
    except (aiohttp.ClientError, OSError) as exc:  # OSError covers ConnectionError
        raise TransientEngineError(f"{type(exc).__name__} talking to {url}: {exc}") from exc
    if status >= 500 or status == 429:
        raise TransientEngineError(f"{url} answered HTTP {status}: {raw[:200]!r}")
    if status >= 400:
        raise EngineError(f"{url} answered HTTP {status}: {raw[:500]!r}")
    return json_object_of(url, raw, "answered")


def json_object_of(url: str, raw: bytes, verb: str) -> dict[str, Any]:
    """An engine's JSON object (an answer, a streamed chunk); malformed or not an object is transient: the
    engine is retried."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TransientEngineError(f"{url} {verb} malformed JSON: {raw[:200]!r}") from exc
    if not isinstance(answer, dict):
        raise TransientEngineError(f"{url} {verb} {type(answer).__name__}, expected a JSON object")
    return answer


def backoff_s(policy: RetryPolicy, failed_attempt: int) -> float:
    """The wait after attempt `failed_attempt` (from 1) failed: exponential, capped, plus up to one base
    of jitter so that many rollouts failing together do not retry in lockstep."""
    exponential = min(policy.max_backoff_s, policy.backoff_s * 2 ** (failed_attempt - 1))
    return max(0.0, exponential) + random.uniform(0, policy.backoff_s)


async def call_with_retries(attempt: Callable[[int], Awaitable[Any]], policy: RetryPolicy, *,
                            on_retry: Callable[[BaseException], None] | None = None) -> Any:
    """Run `attempt(n)` (n counts from 1) until it succeeds, fails for good, or the retries run out."""
    try:
        return await attempt(1)
    except TransientEngineError as exc:
        if policy.retries <= 0:
            raise EngineError(f"{exc} (gave up after 1 attempts)") from exc
        if on_retry is not None:
            on_retry(exc)
        await asyncio.sleep(backoff_s(policy, 1))
    numbers = iter(range(2, policy.retries + 2))
    number = 1

    async def again() -> Any:
        nonlocal number
        number = next(numbers)
        return await attempt(number)

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and state.outcome.exception() is not None:
            on_retry(state.outcome.exception())  # type: ignore[arg-type]

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.retries),
        wait=lambda state: backoff_s(policy, state.attempt_number + 1),
        retry=retry_if_exception_type(TransientEngineError),
        before_sleep=before_sleep,
        sleep=lambda seconds: asyncio.sleep(seconds),  # looked up at call time: tests may replace it
        reraise=True,
    )
    try:
        return await retrying(again)
    except TransientEngineError as exc:
        raise EngineError(f"{exc} (gave up after {number} attempts)") from exc


async def abort_all_requests(target: str, timeout_s: float = 10.0) -> None:
    """Ask an SGLang engine (or router) to abort every request in flight (`POST {engine}/abort_request`
    with `abort_all`; `target` is that whole URL, from `outbound.abort_targets`); the aborted generations
    answer with finish reason `abort` and the clients continue them. Raises EngineError naming the cause
    when the engine does not accept it."""
    try:
        async with aiohttp.ClientSession() as session, session.post(
                target, data=orjson.dumps({"rid": "", "abort_all": True}),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = await response.read()
            if response.status >= 400:
                raise EngineError(f"{target} answered HTTP {response.status}: {body[:200]!r}")
    except TimeoutError as exc:
        raise EngineError(f"no answer from {target} within {timeout_s:g}s") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise EngineError(f"{type(exc).__name__} talking to {target}: {exc}") from exc
