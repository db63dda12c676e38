"""Answered implies replicated: what a request read or wrote that its answer acknowledges, still owed a wait.

With `--redis-wait-replicas N` an answer may acknowledge state only once N replicas hold it, or a failover
right after the answer takes back what the client was told. Writes wait at once (`Store.replicated`), but an
answer can acknowledge state it did not write: a retried turn answered from the stored turn, a repeated
finish or session lookup. The store notes each such read here (`owe`), `Store.replicated` pays what it waits
for (`paid`), and the API's `ReplicatedAnswers` middleware pays whatever a request still owes before the
answer's first byte leaves, so a route cannot forget the wait: it answers 503 "retry" instead. Outside a
request (workers, upkeep) nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

Debt = tuple[str, "str | None"]  # (run id, barrier key or None: the run's own)

_owed: contextvars.ContextVar[set[Debt] | None] = contextvars.ContextVar("rollout_buffer_owed_waits", default=None)


@contextlib.contextmanager
def request_scope() -> Iterator[set[Debt]]:
    """The debts of one request: every task the request runs in shares this one set."""
    debts: set[Debt] = set()
    token = _owed.set(debts)
    try:
        yield debts
    finally:
        _owed.reset(token)


def owe(run_id: str, barrier_key: str | None = None) -> None:
    """The current request's answer will acknowledge state of `run_id` (its replicas must hold it first)."""
    debts = _owed.get()
    if debts is not None:
        debts.add((run_id, barrier_key))


def paid(run_id: str, barrier_key: str | None = None) -> None:
    """The replicas acknowledged everything of `run_id` answered so far."""
    debts = _owed.get()
    if debts is not None:
        debts.discard((run_id, barrier_key))
