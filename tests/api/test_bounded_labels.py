"""Bounded labels: a field the gateway ignores is counted by name only when the API defines it; a client's
invented names all count as `other`, so no request can add counters (or `/metrics` lines) of its own."""

from __future__ import annotations

from typing import Any

import httpx

from rollout_buffer.api.gateway.field_labels import DEFINED, ignored_field_stats
from tests.support.gateway import new_session, start_external
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))


def test_ignored_field_labels_come_from_each_apis_own_list() -> None:
    assert ignored_field_stats("anthropic", ["thinking", "x1", "x2"]) == {
        "gateway_ignored_fields:thinking": 1, "gateway_ignored_fields:other": 1}
    for api in ("openai", "responses"):
        assert ignored_field_stats(api, ["metadata", "zzz"]) == {
            "gateway_ignored_fields:metadata": 1, "gateway_ignored_fields:other": 1}
    assert "messages" in DEFINED["openai"] and "input" in DEFINED["responses"] and "system" in DEFINED["anthropic"]


def test_invented_fields_add_no_counters(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "labels-1")
    invented = {f"field_{i}": i for i in range(300)}
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}, **invented}
    for _ in range(3):
        answer = client.post("/v1/messages", json=body, headers={"x-api-key": session["api_key"]})
        assert answer.status_code == 200, answer.text
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    labels = {k: int(v) for k, v in stats.items() if k.startswith("gateway_ignored_fields:")}
    assert labels == {"gateway_ignored_fields:thinking": 3, "gateway_ignored_fields:other": 3}, labels
    metrics = client.get("/metrics").text
    assert "field_17" not in metrics
