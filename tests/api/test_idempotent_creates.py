"""Idempotent creates: a session create or `/start_rollout` retried with the same `Idempotency-Key` answers
what the first request created, so a client whose first answer was lost (a dropped connection, a 503 from a
replica wait after the session was stored) leaves no orphan session to be reaped as a failed sample."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tests.support.gateway import start_external
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))


def _create(client: httpx.Client, run_id: str, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return client.post(f"/runs/{run_id}/sessions", json={"instance_id": "q1", **body}, headers=headers)


def test_a_retried_session_create_gets_the_first_session(client: httpx.Client, rollout_engine: Any,
                                                         qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=2)
    key = uuid.uuid4().hex
    first = _create(client, run_id, key)
    assert first.status_code == 200, first.text
    retries = [_create(client, run_id, key) for _ in range(3)]
    assert all(r.status_code == 200 and r.json() == first.json() for r in retries), [r.text for r in retries]
    reused = _create(client, run_id, key, metadata={"other": 1})
    assert reused.status_code == 422 and "another body" in reused.json()["message"]
    other = _create(client, run_id, None)
    assert other.json()["session_id"] != first.json()["session_id"]
    assert other.json()["epoch"] == 0, "the retries took no place in the instance's group"
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert int(stats["gateway_sessions_created"]) == 2
    sdk_key = {"Authorization": f"Bearer {first.json()['api_key']}"}
    assert client.get("/v1/models", headers=sdk_key).status_code == 200, "the first session's key works"
    assert _create(client, run_id, "").status_code == 400


def test_a_retried_start_answers_the_first_answer(client: httpx.Client, rollout_engine: Any,
                                                  qwen_tokenizer_path: str) -> None:
    body = {"task_type": "external", "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path,
            "num_repeat_per_sample": 2, "run_id": f"idem-{uuid.uuid4().hex[:8]}"}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = client.post("/start_rollout", json=body, headers=key)
    assert first.status_code == 200 and first.json()["created"] is True, first.text
    again = client.post("/start_rollout", json=body, headers=key)
    assert again.json() == first.json(), "the retry is answered as the first request was"
    plain = client.post("/start_rollout", json=body)
    assert plain.json()["created"] is False
    changed = client.post("/start_rollout", json={**body, "num_repeat_per_sample": 3}, headers=key)
    assert changed.status_code == 422
