"""`ctx.session()`: a native task's in-process OpenAI SDK agent trains through the gateway; the rollout's
record carries the session's turns, the engine's exact ids, grouped like any task's records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.support.gateway import assert_one_branch, assert_turns_are_engine_calls, engine_calls_of
from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import arithmetic_rows, assert_whole_groups, drain, start_native, write_rows

TASKS = str(Path(__file__).resolve().parents[1] / "fixtures" / "gateway_tasks")


def test_an_in_process_sdk_agent_records_token_exact_turns(tmp_path: Path, rollout_engine: Any,
                                                           qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(3)
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                              tokenizer_path=qwen_tokenizer_path, task_type="sdk_agent", repeats=2)
        records = drain(client, run_id, 6)
        stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    for record in records:
        assert record["status"] == "completed", record["extra_info"]
        session_id = record["extra_info"]["session_id"]
        assert session_id.startswith(f"{run_id}~")
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session_id))
        assert_one_branch(record)
        assert len(record["turns"]) == 2 and record["messages"][1]["tool_calls"]
    assert sum(r["reward"] for r in records) == 6, "each agent computed with the tool and answered right"
    assert stats["gateway_turns"] == 12 and "gateway_sessions_timed_out" not in stats
