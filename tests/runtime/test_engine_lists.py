"""Several engines without a router: `remote_engine_url` as a list. Rollouts are dealt out round robin, each
stays on its engine for all its turns, and a dead engine costs retries on the next one, never a rollout."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout_buffer.runtime.engines import EngineRing
from rollout_buffer.runtime.options import RunOptions
from rollout_buffer.security.outbound import parse_engine_urls
from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.wire.schema import StartRolloutRequest
from tests.support.helpers import ServerProcess, free_port
from tests.support.runtime_helpers import (
    arithmetic_rows,
    assert_exact_turns,
    assert_whole_groups,
    drain,
    start_native,
    wait_status,
    write_rows,
)


def test_engine_urls_parse_from_lists_and_separated_text() -> None:
    assert parse_engine_urls("http://a:1/") == ("http://a:1",)
    assert parse_engine_urls("http://a:1, http://b:2/v1 ,http://c:3") == ("http://a:1", "http://b:2/v1", "http://c:3")
    assert parse_engine_urls("http://a:1\nhttps://b") == ("http://a:1", "https://b")
    assert parse_engine_urls(["http://a:1", " http://b:2/ "]) == ("http://a:1", "http://b:2")
    assert parse_engine_urls("") == ()
    for bad in ("a:1", "ftp://a", "http://", ["http://a:1", "b"]):
        with pytest.raises(ValueError, match="is not an http"):
            parse_engine_urls(bad)


def test_a_start_body_may_list_engines_as_json() -> None:
    request = StartRolloutRequest(task_type="math", input_file="x", remote_engine_url=["http://a:1", "http://b:2/"])
    options = RunOptions.from_request(request, rollout_timeout_s=1)
    assert options.engine_urls == ("http://a:1", "http://b:2") and options.engine_url == "http://a:1"
    with pytest.raises(ValueError, match="only strings"):
        StartRolloutRequest(task_type="math", input_file="x", remote_engine_url=["http://a:1", 2])


def test_rollouts_go_round_robin_and_a_failed_engine_is_skipped_for_a_while() -> None:
    ring = EngineRing(("http://a", "http://b", "http://c"), cooldown_s=60.0, _next=0)
    assert [ring.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    choice = ring.pick()  # http://b
    choice.failover()
    assert choice.url == "http://c"  # this rollout retries elsewhere
    assert [ring.pick().url for _ in range(3)] == ["http://c", "http://a", "http://c"]  # b cools down
    for index in range(3):
        ring.failed(index)
    assert [ring.pick().url for _ in range(3)] == ["http://a", "http://b", "http://c"]  # all failed: all tried
    lone = EngineRing(("http://only",)).pick()
    lone.failover()
    assert lone.url == "http://only"


@pytest.fixture()
def client(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=30) as c:
        yield c


def test_a_bad_engine_url_in_the_list_is_refused_by_name(client: httpx.Client, tmp_path: Path,
                                                          qwen_tokenizer_path: str) -> None:
    body = {"task_type": "math", "input_file": str(write_rows(tmp_path, arithmetic_rows(2))),
            "remote_engine_url": ["http://127.0.0.1:1", "127.0.0.1:2"], "tokenizer_path": qwen_tokenizer_path}
    answer = client.post("/start_rollout", json=body)
    assert answer.status_code == 400, answer.text
    assert "remote_engine_url" in answer.text and "'127.0.0.1:2' is not an http(s) URL" in answer.text


def test_listed_engines_share_rollouts_each_sticky_with_exact_turns(client: httpx.Client, tmp_path: Path,
                                                                   qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(12)
    with run_engine_in_thread(template="qwen2.5", seed=11, engine_id="A") as a, \
            run_engine_in_thread(template="qwen2.5", seed=11, engine_id="B") as b:
        run_id = start_native(client, write_rows(tmp_path, rows), engine_url=f"{a.url}, {b.url}",
                              tokenizer_path=qwen_tokenizer_path, task_type="calculator", repeats=2, num_process=8)
        records = drain(client, run_id, 24)
        keys_a, keys_b = dict(a.routing_keys), dict(b.routing_keys)
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    for record in records:
        assert record["status"] == "completed"
        assert_exact_turns(record)
        # every turn of a rollout went to one engine: its routing key (the uid) is on exactly one of them
        on = [keys for keys in (keys_a, keys_b) if record["uid"] in keys]
        assert len(on) == 1 and on[0][record["uid"]] == len(record["turns"]), record["uid"]
    assert len(keys_a) == len(keys_b) == 12  # round robin: half each


def test_a_dead_engine_in_the_list_costs_retries_not_rollouts(client: httpx.Client, tmp_path: Path,
                                                             qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(8)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    with run_engine_in_thread(template="qwen2.5", seed=12, engine_id="live") as live:
        run_id = start_native(client, write_rows(tmp_path, rows), engine_url=[dead, live.url],
                              tokenizer_path=qwen_tokenizer_path, repeats=2, num_process=4, engine_backoff_s="0.01")
        records = drain(client, run_id, 16)
        served = dict(live.routing_keys)
    assert all(r["status"] == "completed" for r in records) and len(served) == 16
    stats = wait_status(client, run_id, "finished")["stats"]
    assert stats["engine_failovers"] >= 1 and stats["engine_retries"] == stats["engine_failovers"]
