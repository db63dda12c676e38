"""Answered implies replicated: the one middleware that holds back an answer until the replicas have what it
acknowledges (`rollout_buffer.store.acks`), and the one place Redis failures become 503 with Retry-After."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollout_buffer.api.errors import install_error_handlers
from rollout_buffer.api.replicated_answers import ReplicatedAnswers
from rollout_buffer.store import acks
from rollout_buffer.store.replication import ReplicaWaitError


class _Replicas:
    """A store whose replicas are away (`away`) or acknowledge at once; records what it waited for."""

    def __init__(self, away: bool) -> None:
        self.away = away
        self.waited: list[str] = []

    async def settle(self, debts: set[acks.Debt]) -> None:
        for run_id, _ in sorted(debts):
            if self.away:
                raise ReplicaWaitError("only 0 of 1 replica(s) acknowledged the write within 2000 ms "
                                       "(--redis-wait-replicas); retry")
            self.waited.append(run_id)


def _app(store: _Replicas) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ReplicatedAnswers)
    app.state.buffer = SimpleNamespace(store=store)

    @app.get("/replay")
    async def replay() -> dict[str, Any]:  # a stored answer read, not written: owes a wait all the same
        acks.owe("r1")
        return {"ok": True}

    @app.get("/paid")
    async def paid() -> dict[str, Any]:  # a write that waited itself owes nothing more
        acks.owe("r1")
        acks.paid("r1")
        return {"ok": True}

    @app.get("/refused")
    async def refused() -> dict[str, Any]:
        acks.owe("r1")
        raise ValueError("a bug")

    @app.get("/plain")
    async def plain() -> dict[str, Any]:
        return {"ok": True}

    return app


def test_an_answer_that_acknowledges_a_stored_state_waits_for_the_replicas() -> None:
    store = _Replicas(away=False)
    with TestClient(_app(store)) as client:
        assert client.get("/replay").status_code == 200
        assert store.waited == ["r1"]
        assert client.get("/paid").status_code == 200 and client.get("/plain").status_code == 200
        assert store.waited == ["r1"], "nothing owed: no second wait"


def test_replicas_away_turn_the_answer_into_503_retry() -> None:
    store = _Replicas(away=True)
    with TestClient(_app(store), raise_server_exceptions=False) as client:
        held = client.get("/replay")
        assert held.status_code == 503 and held.headers["Retry-After"] == "1"
        assert "--redis-wait-replicas" in held.json()["message"]
        assert client.get("/plain").status_code == 200, "an answer that acknowledges nothing is not held"
        assert client.get("/refused").status_code == 500, "a bug is not dressed up as a retry"


def test_redis_failures_are_503_with_retry_after_on_every_route() -> None:
    """redis-py's own AttributeError in a failover (`redis_client.is_outage`) and a lost connection are both
    503 "retry" with Retry-After; an AttributeError of the route's own code stays a 500."""
    app = FastAPI()
    install_error_handlers(app)
    namespace: dict[str, Any] = {}
    exec(compile("def send():\n    None.writelines([])\n", "/venv/site-packages/redis/asyncio/connection.py",
                 "exec"), namespace)

    @app.get("/client-bug")
    async def client_bug() -> None:
        namespace["send"]()

    @app.get("/our-bug")
    async def our_bug() -> None:
        None.writelines([])  # type: ignore[attr-defined]

    @app.get("/lost")
    async def lost() -> None:
        raise ReplicaWaitError("only 0 of 1 replica(s)")

    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("/client-bug", "/lost"):
            answer = client.get(path)
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", (path, answer.text)
            assert "retry" in answer.json()["message"]
        assert client.get("/our-bug").status_code == 500
