"""The one place where "answered" implies "replicated" (`rollout_buffer.store.acks`).

Before a response's status line is sent, every replica wait the request still owes is paid. If the replicas
do not answer in time (or Redis is failing over), the client gets 503 "retry" with `Retry-After` instead of
the answer: retrying is safe, as every acknowledged operation is idempotent (writes by uid, leased reads by
batch id, acks, turns by request, finishes by session). Answers that acknowledge nothing (4xx about the
request itself, 5xx) are sent as they are.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_buffer.api.errors import retry_response
from rollout_buffer.store import acks
from rollout_buffer.store.redis_client import is_outage

log = logging.getLogger(__name__)

# statuses whose answer states something stored: a success, a session or run gone, a write refused by state
_ACKNOWLEDGING = (404, 409)


def acknowledges(status: int) -> bool:
    return status < 400 or status in _ACKNOWLEDGING


class ReplicatedAnswers:
    """ASGI middleware: pay a request's owed replica waits before its answer (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with acks.request_scope() as debts:
            replaced = False

            async def guarded_send(message: Message) -> None:
                nonlocal replaced
                if replaced:
                    return  # the original answer's body: its status line was replaced by a 503
                if message["type"] == "http.response.start" and debts and acknowledges(message["status"]):
                    state = getattr(scope["app"].state, "buffer", None)
                    try:
                        if state is not None:
                            await state.store.settle(debts)
                    except Exception as exc:
                        if not is_outage(exc):
                            raise
                        replaced = True
                        log.warning("%s %s: answer held back: %s", scope.get("method"), scope.get("path"), exc)
                        await retry_response(f"not acknowledged; retry the request: {exc}")(scope, receive, send)
                        return
                await send(message)

            await self.app(scope, receive, guarded_send)
