"""The one completion callback of a remote rollout: `POST {server_url}/v1/rollout/completed`.

The body is stored in Redis before the first attempt (`callback`, `callback_status=pending`) and every
attempt carries `Idempotency-Key: <rollout_id>`. Connection errors, timeouts, 408/429 and 5xx are retried
with exponential backoff (tenacity) until the deadline; the first 2xx is recorded as `delivered` and nothing
is sent again. A crash between a 2xx and that record can at worst resend the same body under the same key,
which the trainer dedupes. Another 4xx means the trainer refuses the body: retrying cannot help, so it is
recorded as `failed` with the trainer's answer. Delivered and failed rollouts are settled: left alone by
restarts, their state expires after `settled_ttl_s`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from rollout_buffer.remote.settings import RemoteSettings
from rollout_buffer.remote.state import RemoteStates
from rollout_buffer.security.access import AccessPolicy

log = logging.getLogger(__name__)
CALLBACK_PATH = "/v1/rollout/completed"


class _Retryable(Exception):
    """An attempt that may succeed if repeated."""


class CallbackRefused(Exception):
    """The trainer answered 4xx: the body will not be accepted however often it is sent."""


@dataclass
class CallbackSender:
    session: aiohttp.ClientSession
    states: RemoteStates
    settings: RemoteSettings
    owner: str
    access: AccessPolicy | None = None  # `--allow-url`: a callback URL outside it is never called


    async def deliver(self, rollout_id: str, server_url: str, body: dict[str, Any]) -> bool:
        """Deliver once; True when some attempt got a 2xx (now or before)."""
        url = f"{server_url.rstrip('/')}{CALLBACK_PATH}"
        if self.access is not None and not self.access.url_ok(url):
            await self._record_failure(rollout_id, f"callback URL {url!r} is not under a URL this server may call "
                                                   "(--allow-url)")
            return False
        payload = orjson.dumps(body)
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.settings.callback_deadline_s),
            wait=wait_exponential_jitter(initial=self.settings.callback_backoff_s,
                                         max=self.settings.callback_max_backoff_s,
                                         jitter=self.settings.callback_backoff_s),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        try:
            async for trial in retrying:
                with trial:
                    current = await self.states.get(rollout_id)
                    if current is None or current.get("owner") != self.owner:
                        log.warning("rollout %s: no longer ours; its callback is left to the new owner", rollout_id)
                        return False
                    if current.get("callback_status") == "delivered":
                        return True
                    await self.states.incr(rollout_id, "callback_attempts")
                    await self._attempt(url, rollout_id, payload)
        except _Retryable as exc:
            await self._record_failure(rollout_id, f"gave up after {self.settings.callback_deadline_s:g}s: {exc}")
            return False
        except CallbackRefused as exc:
            await self._record_failure(rollout_id, str(exc))
            return False
        await self.states.update(rollout_id, self.owner, callback_status="delivered",
                                 callback_delivered_at=time.time(), callback_error="")
        await self.states.settle(rollout_id, self.settings.settled_ttl_s)
        return True

    async def _attempt(self, url: str, rollout_id: str, payload: bytes) -> None:
        headers = {"Content-Type": "application/json", "Idempotency-Key": rollout_id}
        try:
            async with self.session.post(url, data=payload, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.settings.callback_timeout_s)) as answer:
                text = (await answer.read())[:300]
                status = answer.status
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            await self._note(rollout_id, f"{type(exc).__name__}: {exc}")
            raise _Retryable(f"{type(exc).__name__} posting to {url}: {exc}") from exc
        if 200 <= status < 300:
            return
        message = f"{url} answered HTTP {status}: {text!r}"
        await self._note(rollout_id, message)
        if status >= 500 or status in (408, 425, 429):
            raise _Retryable(message)
        raise CallbackRefused(message)

    async def _note(self, rollout_id: str, error: str) -> None:
        log.info("rollout %s: callback attempt failed: %s", rollout_id, error)
        await self.states.update(rollout_id, self.owner, callback_error=error[:1000])

    async def _record_failure(self, rollout_id: str, error: str) -> None:
        """A refusal or a passed deadline is final: recorded as `failed` and settled like a delivery."""
        log.error("rollout %s: completion callback not delivered: %s", rollout_id, error)
        if await self.states.update(rollout_id, self.owner, callback_status="failed", callback_error=error[:1000]):
            await self.states.settle(rollout_id, self.settings.settled_ttl_s)
