"""Failed rollouts are loud once, not once per rollout: `GET /runs/{id}` groups them by error type with a
count and the first example; the worker log has one line per new type and periodic counts."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.metrics.failures import failure_summary
from rollout_buffer.runtime.failure_log import FailureLog
from rollout_buffer.store.store import Store
from tests.support.doc_pages import all_docs
from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import arithmetic_rows, start_native, wait_status, write_rows


def failed(i: int, error_type: str, message: str) -> dict[str, Any]:
    return {"uid": f"run:0:{i}:0", "status": "failed", "extra_info": {"error_type": error_type, "error": message}}


async def test_each_type_is_announced_once_then_counted_per_interval(redis_store: Store,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_buffer.runtime.failure_log")
    now = [100.0]
    flog = FailureLog("unit-failures", interval_s=30.0, clock=lambda: now[0])
    for i in range(50):
        await flog.note(redis_store.redis, failed(i, "EngineError", f"HTTP 500 from the engine ({i})"))
        now[0] += 0.1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "new error type EngineError" in lines[0] and "run:0:0:0" in lines[0] and "(0)" in lines[0]
    now[0] = 131.0
    await flog.note(redis_store.redis, failed(50, "InvalidSample", "prompt: missing"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "new error type InvalidSample" in lines[1]
    assert "51 rollout(s) failed in the last 31 s: EngineError x50, InvalidSample x1" in lines[2]
    other_process = FailureLog("unit-failures", clock=lambda: now[0])
    await other_process.note(redis_store.redis, failed(51, "EngineError", "HTTP 500 again"))
    assert len(caplog.records) == 3, "a type already announced by any worker is not announced again"
    stats = {"rollout_errors:EngineError": 51, "rollout_errors:InvalidSample": 1, "tasks_done": 3}
    summary = await failure_summary(redis_store.redis, "unit-failures", stats)
    assert summary["total"] == 52 and list(summary["by_type"]) == ["EngineError", "InvalidSample"]
    assert summary["by_type"]["EngineError"]["count"] == 51
    assert summary["by_type"]["EngineError"]["example"] == "HTTP 500 from the engine (0)", "the first one is kept"
    assert summary["first_error"]["type"] == "EngineError" and summary["first_error"]["uid"] == "run:0:0:0"
    assert (await failure_summary(redis_store.redis, "no-failures", {}))["by_type"] == {}
    interval = FailureLog("any").interval_s
    documented = " ".join(all_docs().split())
    assert f"one line per new error type and a count every {interval:g} s" in documented, "docs/delivery.md"


@pytest.fixture()
def failing_engine() -> Iterator[Any]:
    from rollout_buffer.testing.engine import run_engine_in_thread

    with run_engine_in_thread(template="qwen2.5", seed=3, error_rate=1.0) as engine:
        yield engine


def test_a_run_of_failing_rollouts_shows_why(runtime_server: ServerProcess, failing_engine: Any,
                                             qwen_tokenizer_path: str, tmp_path: Path) -> None:
    with httpx.Client(base_url=runtime_server.url, timeout=30) as client:
        run_id = start_native(client, write_rows(tmp_path, arithmetic_rows(8)), engine_url=failing_engine.url,
                              tokenizer_path=qwen_tokenizer_path, repeats=4, engine_retries="0")
        detail = wait_status(client, run_id, "finished", timeout_s=60)
    assert detail["tasks"]["failed"] == 32
    failures = detail["failures"]
    assert failures["total"] == 32 and list(failures["by_type"]) == ["EngineError"]
    engine_errors = failures["by_type"]["EngineError"]
    assert engine_errors["count"] == 32 and "500" in engine_errors["example"]
    assert failures["first_error"]["uid"].startswith(f"{run_id}:")
    with httpx.Client(base_url=runtime_server.url, timeout=30) as client:
        read = client.post("/get_rollout_data", json={"run_id": run_id}).json()["data"]
        drops = client.get(f"/runs/{run_id}").json()["drops"]
    meta = read["meta_info"]
    assert sorted(meta["failed_groups"]) == sorted(meta["finished_groups"]) == sorted(f"q{i}" for i in range(8))
    # the README: a group whose rollouts all failed returns no sample; it is filtered out and counted as a drop
    assert read["data"] == [] and sorted(meta["filtered_groups"]) == sorted(meta["failed_groups"])
    assert drops["filtered_group"] == 8, drops
    log = [line for line in runtime_server.log_path.read_text().splitlines() if run_id in line]
    assert sum("new error type EngineError" in line for line in log) == 1, log
    assert len(log) <= 2, f"one line per new type (plus at most a periodic count), not one per rollout: {log}"


@pytest.fixture()
def flaky_engine() -> Iterator[Any]:
    from rollout_buffer.testing.engine import run_engine_in_thread

    with run_engine_in_thread(template="qwen2.5", seed=5, error_rate=0.5) as engine:
        yield engine


def test_a_read_returns_failed_members_of_a_group_but_no_group_that_only_failed(
        runtime_server: ServerProcess, flaky_engine: Any, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    """What the README says a read gives: a group with a member that did not fail comes whole, its failed
    members included (status failed, reward 0); a group whose members all failed gives no sample, and is named
    in `failed_groups` and `filtered_groups`."""
    with httpx.Client(base_url=runtime_server.url, timeout=30) as client:
        run_id = start_native(client, write_rows(tmp_path, arithmetic_rows(8)), engine_url=flaky_engine.url,
                              tokenizer_path=qwen_tokenizer_path, repeats=4, engine_retries="0")
        detail = wait_status(client, run_id, "finished", timeout_s=60)
        answer = client.post("/get_rollout_data", json={"run_id": run_id}).json()["data"]
        drops = client.get(f"/runs/{run_id}").json()["drops"]
    meta, records = answer["meta_info"], answer["data"]
    failed_tasks = detail["tasks"]["failed"]
    assert 0 < failed_tasks < 32 and detail["failures"]["total"] == failed_tasks, detail["tasks"]
    assert sorted(meta["finished_groups"]) == [f"q{i}" for i in range(8)], "every group handed over"
    by_group: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_group.setdefault(record["instance_id"], []).append(record)
    assert all(len(members) == 4 for members in by_group.values()), "groups come whole"
    assert set(meta["failed_groups"]) <= set(meta["filtered_groups"]) and not set(meta["failed_groups"]) & set(by_group)
    assert set(by_group) | set(meta["failed_groups"]) == set(meta["finished_groups"])
    assert drops.get("filtered_group", 0) == len(meta["failed_groups"]), "each all-failed group counted as a drop"
    returned_failed = [r for r in records if r["status"] == "failed"]
    assert returned_failed, "with half the engine calls failing, some group mixes failed and finished members"
    assert len(returned_failed) == failed_tasks - 4 * len(meta["failed_groups"]), "every failed member returned"
    assert all(r.get("raw_reward", r["reward"]) == 0.0 and r["extra_info"].get("error_type") for r in returned_failed)


LEAKY = "POST http://buffer:8000/cap/k3y-s3cret/buffer/write?token=t0ken-s3cret failed: 500"


async def test_error_texts_are_redacted_before_they_are_stored(redis_store: Store) -> None:
    """A failure's text reaches Redis, `GET /runs/{id}` and the trainer; an HTTP error quoting the URL it
    called must not carry the capability key or the token there (logs are redacted the same way)."""
    from rollout_buffer.runtime.records import failure_record, success_record

    common: dict[str, Any] = {"uid": "r:0:0:0", "instance_id": "q0", "epoch": 0, "repeat": 0, "attempt": 0,
                              "tools": None, "duration_s": 0.1}
    built = failure_record(RuntimeError(LEAKY), messages=[], **common)
    returned = success_record({"messages": [], "reward": 0.0, "status": "failed",
                               "extra_info": {"error": LEAKY, "error_type": "AgentError", "kept": 1}},
                              turns=[], last_finish=None, **common)
    for record in (built, returned):
        text = record["extra_info"]["error"]
        assert "s3cret" not in text and text.count("<redacted>") == 2 and "/buffer/write" in text, text
    assert returned["extra_info"]["kept"] == 1, "the task's other extra_info fields stay"
    await FailureLog("unit-redacted").note(redis_store.redis, failed(0, "HTTPError", LEAKY))
    summary = await failure_summary(redis_store.redis, "unit-redacted", {"rollout_errors:HTTPError": 1})
    assert "s3cret" not in summary["by_type"]["HTTPError"]["example"]
