"""Engine faults (500s, aborts, hangs, malformed JSON): rollouts retry, continue or fail visibly, groups
complete, the counts add up, and nothing hangs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import (
    arithmetic_rows,
    assert_exact_turns,
    assert_whole_groups,
    drain,
    start_native,
    wait_status,
    write_rows,
)

FAULTS_OFF = {"error_rate": 0, "abort_rate": 0, "hang_rate": 0, "malformed_rate": 0, "fail_next": 0, "abort_next": 0,
              "hang_next": 0, "malformed_next": 0, "latency_s": 0}


@pytest.fixture()
def client(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=30) as c:
        yield c


@pytest.fixture()
def engine(rollout_engine: Any) -> Iterator[Any]:
    rollout_engine.configure(**FAULTS_OFF)
    yield rollout_engine
    rollout_engine.configure(**FAULTS_OFF)


def _run(client: httpx.Client, engine: Any, tokenizer_path: str, tmp_path: Path, n: int, repeats: int,
         **extra: Any) -> tuple[str, list[str]]:
    rows = arithmetic_rows(n)
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=engine.url, tokenizer_path=tokenizer_path,
                          repeats=repeats, num_process=4, engine_backoff_s="0.01", **extra)
    return run_id, [r["instance_id"] for r in rows]


def test_http_500s_are_retried_with_backoff(client: httpx.Client, engine: Any, qwen_tokenizer_path: str,
                                            tmp_path: Path) -> None:
    before = engine.stats_dict()["errors_injected"]
    engine.configure(fail_next=12)
    run_id, ids = _run(client, engine, qwen_tokenizer_path, tmp_path, 6, 4, engine_retries="12")
    records = drain(client, run_id, 24)
    assert_whole_groups(records, instance_ids=ids, epochs=1, repeats=4)
    assert all(r["status"] == "completed" for r in records)
    assert engine.stats_dict()["errors_injected"] - before == 12
    detail = wait_status(client, run_id, "finished")
    assert detail["stats"]["engine_retries"] == 12, "each injected 500 costs exactly one retry"


def test_malformed_answers_are_retried(client: httpx.Client, engine: Any, qwen_tokenizer_path: str,
                                       tmp_path: Path) -> None:
    engine.configure(malformed_next=6)
    run_id, ids = _run(client, engine, qwen_tokenizer_path, tmp_path, 4, 3, engine_retries="6")
    records = drain(client, run_id, 12)
    assert_whole_groups(records, instance_ids=ids, epochs=1, repeats=3)
    assert all(r["status"] == "completed" for r in records)
    assert wait_status(client, run_id, "finished")["stats"]["engine_retries"] == 6


def test_aborted_generations_are_continued_into_one_turn(client: httpx.Client, engine: Any, qwen_tokenizer_path: str,
                                                         qwen_tokenizer: Any, tmp_path: Path) -> None:
    before = engine.stats_dict()["aborts_injected"]
    engine.configure(abort_next=10)
    run_id, ids = _run(client, engine, qwen_tokenizer_path, tmp_path, 6, 4)
    records = drain(client, run_id, 24)
    assert_whole_groups(records, instance_ids=ids, epochs=1, repeats=4)
    assert engine.stats_dict()["aborts_injected"] - before == 10
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record in records:
        assert record["status"] == "completed" and len(record["turns"]) == 1
        assert_exact_turns(record)
        turn = record["turns"][0]
        assert turn["finish_reason"] == "stop" and turn["output_ids"][-1] == eos
        expected = qwen_tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        assert turn["prompt_ids"] == list(expected), "a continued turn keeps the original prompt"
    detail = wait_status(client, run_id, "finished")
    assert detail["stats"]["engine_abort_continuations"] == 10
    assert detail["stats"]["engine_calls"] == 24 + 10


def test_hung_calls_time_out_and_are_retried(client: httpx.Client, engine: Any, qwen_tokenizer_path: str,
                                             tmp_path: Path) -> None:
    engine.configure(hang_next=3)
    started = time.monotonic()
    run_id, ids = _run(client, engine, qwen_tokenizer_path, tmp_path, 4, 2, engine_timeout_s="0.5",
                       engine_retries="3")
    records = drain(client, run_id, 8, timeout_s=20)
    assert_whole_groups(records, instance_ids=ids, epochs=1, repeats=2)
    assert all(r["status"] == "completed" for r in records)
    assert time.monotonic() - started < 15
    assert wait_status(client, run_id, "finished")["stats"]["engine_retries"] == 3


def test_an_engine_that_always_fails_gives_failed_records_and_closed_groups(client: httpx.Client, engine: Any,
                                                                            qwen_tokenizer_path: str,
                                                                            tmp_path: Path) -> None:
    engine.configure(error_rate=1.0)
    run_id, ids = _run(client, engine, qwen_tokenizer_path, tmp_path, 3, 2, engine_retries="1")
    detail = wait_status(client, run_id, "finished", timeout_s=20)
    assert detail["tasks"] == {"queued": 0, "running": 0, "done": 0, "failed": 6}
    assert detail["stats"]["rollout_errors:EngineError"] == 6 and detail["stats"]["engine_retries"] == 6
    answer = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    # Groups whose members all failed are complete, filtered by the default validity hook, and reported.
    meta = answer["data"]["meta_info"]
    assert sorted(meta["finished_groups"]) == sorted(ids) and sorted(meta["filtered_groups"]) == sorted(ids)
    assert answer["data"]["data"] == []


def test_mixed_faults_every_task_accounted_for(client: httpx.Client, engine: Any, qwen_tokenizer_path: str,
                                              tmp_path: Path) -> None:
    engine.configure(error_rate=0.15, abort_rate=0.15, hang_rate=0.05, malformed_rate=0.1, seed=11)
    run_id, _ = _run(client, engine, qwen_tokenizer_path, tmp_path, 12, 4, engine_timeout_s="0.3",
                       engine_retries="1", epochs=2)
    detail = wait_status(client, run_id, "finished", timeout_s=40)
    tasks, stats = detail["tasks"], detail["stats"]
    assert tasks["done"] + tasks["failed"] == 12 * 4 * 2 and tasks["queued"] == tasks["running"] == 0
    assert stats.get("status:failed", 0) == tasks["failed"]
    assert stats["engine_retries"] > 0
    answer = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    meta = answer["data"]["meta_info"]
    assert len(meta["finished_groups"]) == 12 * 2, "every group completed, failed members included"
    handed = answer["data"]["data"]
    assert len(handed) == 4 * (24 - len(meta["filtered_groups"]))
    for record in handed:
        if record["status"] != "failed":
            assert_exact_turns(record)
