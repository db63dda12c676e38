"""The rollout runtime end to end: a real server process (on the embedded Redis and on a real 3-node Redis
Cluster), the SGLang test engine, the real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.backends import CLUSTER_BACKENDS, backend
from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import (
    RUNTIME_SERVER_ARGS,
    arithmetic_rows,
    assert_exact_turns,
    assert_whole_groups,
    drain,
    start_native,
    wait_status,
    write_rows,
)


@pytest.fixture(scope="module", params=CLUSTER_BACKENDS)
def buffer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared runtime server (embedded Redis), or one like it on the real 3-node Redis Cluster."""
    if request.param == "embedded":
        yield request.getfixturevalue("runtime_server")
        return
    with ServerProcess(tmp_path_factory.mktemp("runtime-cluster"), *RUNTIME_SERVER_ARGS,
                       *backend(request).server_args()) as proc:
        yield proc


@pytest.fixture()
def client(buffer: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=buffer.url, timeout=30) as c:
        yield c


def test_math_every_group_whole_and_once_with_exact_turns(client: httpx.Client, rollout_engine: Any,
                                                          qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                          tmp_path: Path) -> None:
    rows = arithmetic_rows(64)
    routed_before = rollout_engine.stats_dict()["routing_key_requests"]
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, repeats=8, epochs=2, num_process=128)
    records = drain(client, run_id, 64 * 8 * 2, timeout_s=60)
    groups = assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=2, repeats=8)
    assert len(groups) == 128
    for record in records:
        assert record["status"] == "completed" and record["weight_version"] == "default"
        assert record["uid"] == f"{run_id}:{record['epoch']}:{record['instance_id']}:{record['repeat']}"
        assert len(record["turns"]) == 1
        assert_exact_turns(record)
        expected_prompt = qwen_tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True,
                                                             tokenize=True, return_dict=False)
        assert record["turns"][0]["prompt_ids"] == list(expected_prompt)
        assert record["raw_reward"] in (0.0, 1.0)
    rewards = {r["raw_reward"] for r in records}
    assert rewards == {0.0, 1.0}, "the engine answers right about half the time; both rewards must occur"
    for members in groups.values():  # GRPO hook ran: normalised rewards sum to ~0 in each group
        assert abs(sum(m["reward"] for m in members)) < 1e-3
    detail = wait_status(client, run_id, "finished")
    assert detail["tasks"] == {"queued": 0, "running": 0, "done": 1024, "failed": 0}
    assert rollout_engine.stats_dict()["routing_key_requests"] - routed_before >= 1024


def test_calculator_multi_turn_tool_messages_and_exact_turns(client: httpx.Client, rollout_engine: Any,
                                                             qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                             tmp_path: Path) -> None:
    rows = arithmetic_rows(8)
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, task_type="calculator", repeats=4)
    records = drain(client, run_id, 32)
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=4)
    for record in records:
        messages, turns = record["messages"], record["turns"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        call = messages[1]["tool_calls"][0]
        assert messages[2]["tool_call_id"] == call["id"] and call["function"]["name"] == "calculator"
        assert record["reward"] == 1.0 and record["extra_info"]["tool_calls"] == 1
        assert record["tools"][0]["function"]["name"] == "calculator"
        assert len(turns) == 2
        assert_exact_turns(record)
        first = qwen_tokenizer.apply_chat_template(messages[:1], tools=record["tools"], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
        assert turns[0]["prompt_ids"] == list(first)
        assert turns[0]["output_ids"][-1] == qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
        head = len(turns[0]["prompt_ids"]) + len(turns[0]["output_ids"])
        tail = qwen_tokenizer.decode(turns[1]["prompt_ids"][head:], skip_special_tokens=False)
        # Exactly what the Qwen2.5 template writes after an assistant turn that ended with <|im_end|>:
        assert tail == (f"\n<|im_start|>user\n<tool_response>\n{messages[2]['content']}\n</tool_response>"
                        "<|im_end|>\n<|im_start|>assistant\n")


def test_slime_style_legacy_module_runs_unchanged(client: httpx.Client, tmp_path: Path) -> None:
    rows = [{"instance_id": f"L{i}", "prompt": f"prompt {i}"} for i in range(6)]
    body = {"task_type": "slime_style", "input_file": str(write_rows(tmp_path, rows)), "num_repeat_per_sample": "3",
            "num_epoch": "2", "num_process": "4", "run_id": "legacy-run"}
    response = client.post("/start_rollout", json=body)
    assert response.status_code == 200, response.text
    records = drain(client, "legacy-run", 6 * 3 * 2)
    groups: dict[tuple[int, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["epoch"], record["instance_id"]), []).append(record)
    assert set(groups) == {(e, r["instance_id"]) for e in range(2) for r in rows}
    assert all(sorted(m["extra_info"]["repeat"] for m in g) == [0, 1, 2] for g in groups.values())
    assert wait_status(client, "legacy-run", "finished")["records"]["written"] == 36
    again = client.post("/start_rollout", json=body).json()
    assert again["created"] is False
    assert not client.post("/get_rollout_data", json={"run_id": "legacy-run"}).json()["success"]


def test_chat_completions_engine_api_records_messages_without_turns(client: httpx.Client, rollout_engine: Any,
                                                                    tmp_path: Path) -> None:
    rows = arithmetic_rows(4)
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url, tokenizer_path="",
                          task_type="calculator", repeats=2, engine_api="chat")
    records = drain(client, run_id, 8)
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    for record in records:
        assert record.get("turns") is None
        assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert record["reward"] == 1.0


def test_misbehaving_tasks_become_failure_records_and_groups_complete(client: httpx.Client, rollout_engine: Any,
                                                                      qwen_tokenizer_path: str,
                                                                      tmp_path: Path) -> None:
    modes = {"ok": None, "raise": "RuntimeError", "hang": "RolloutTimeout", "rewrite": "HistoryRewriteError",
             "bad_result": "ValueError"}
    rows = [{"instance_id": mode, "prompt": "What is 2 + 2?", "mode": mode} for mode in modes]
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, task_type="misbehave", repeats=2,
                          rollout_timeout_s="1.0")
    records = drain(client, run_id, 10, timeout_s=30)
    assert_whole_groups(records, instance_ids=list(modes), epochs=1, repeats=2)
    for record in records:
        expected = modes[record["instance_id"]] if record["repeat"] == 0 else None
        if expected is None:
            assert record["status"] == "completed" and record["reward"] == 1.0
        else:
            assert record["status"] == "failed" and record["reward"] == 0.0 and record.get("turns") is None
            assert record["extra_info"]["error_type"] == expected, record["extra_info"]
            assert record["extra_info"]["error"]
    rewrite = next(r for r in records if r["instance_id"] == "rewrite" and r["repeat"] == 0)
    assert "append-only" in rewrite["extra_info"]["error"]
    detail = wait_status(client, run_id, "finished")
    assert detail["tasks"] == {"queued": 0, "running": 0, "done": 6, "failed": 4}
    assert detail["stats"]["rollout_errors:RolloutTimeout"] == 1


def test_bad_input_files_are_refused_naming_the_line_and_enqueue_nothing(client: httpx.Client, rollout_engine: Any,
                                                                         qwen_tokenizer_path: str,
                                                                         tmp_path: Path) -> None:
    def start(path: Path, run_id: str, **extra: Any) -> httpx.Response:
        body = {"task_type": "math", "input_file": str(path), "remote_engine_url": rollout_engine.url,
                "tokenizer_path": qwen_tokenizer_path, "run_id": run_id, **extra}
        return client.post("/start_rollout", json=body)

    duplicate = tmp_path / "dup.jsonl"
    duplicate.write_text('{"instance_id": "a", "prompt": "x"}\n{"prompt": "y"}\n{"instance_id": "a", "prompt": "z"}\n')
    response = start(duplicate, "bad-dup")
    assert response.status_code == 400 and "line 3" in response.text and "duplicate instance_id" in response.text
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "x"}\n\n{"prompt": \n')
    response = start(broken, "bad-json")
    assert response.status_code == 400 and "line 3" in response.text and "input_file" in response.text
    for run_id in ("bad-dup", "bad-json"):
        assert client.get(f"/runs/{run_id}").status_code == 404, "a refused start stores no run"
        assert run_id not in client.get("/runs").json()["runs"]
    fine = write_rows(tmp_path, arithmetic_rows(2), "fine.jsonl")
    response = start(fine, "no-engine", remote_engine_url="")
    assert response.status_code == 400 and "remote_engine_url" in response.text
    response = start(fine, "bad-api", engine_api="grpc")
    assert response.status_code == 400 and "engine_api" in response.text


def test_relaunch_enqueues_nothing_new(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str,
                                       tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(5)]  # ids from line numbers
    path = write_rows(tmp_path, rows)
    run_id = start_native(client, path, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                          repeats=3, epochs=2)
    body = {"task_type": "math", "input_file": str(path), "num_repeat_per_sample": "3", "num_epoch": "2",
            "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path, "run_id": run_id,
            "sampling_params": {"max_tokens": 256, "temperature": 1.0}}
    assert client.post("/start_rollout", json=body).json()["created"] is False
    records = drain(client, run_id, 30)
    assert_whole_groups(records, instance_ids=[str(i) for i in range(5)], epochs=2, repeats=3)
    assert client.post("/start_rollout", json=body).json()["created"] is False
    detail = wait_status(client, run_id, "finished")
    assert detail["meta"]["tasks_total"] == "30" and detail["tasks"]["done"] == 30
    assert detail["records"]["duplicates"] == 0
