"""slime's prompt files through a real buffer: its dataset keys map every line before the task sees it, the
engine renders exactly the line's prompt (and its tools), a file the task cannot read is refused at start
with nothing stored, and a run started with `"activate": false` leaves the active run alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import assert_exact_turns, assert_whole_groups, drain, start_native, write_rows

DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the "
                 "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SLIME_DAPO_KEYS = {"input_key": "prompt", "label_key": "label", "metadata_key": "metadata", "tool_key": None}


def dapo_rows(n: int) -> list[dict[str, Any]]:
    """dapo-math-17k's shape: `prompt` a one-message chat list, `label` the answer; integer ids on even lines,
    none on odd ones (their ids come from the line number)."""
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"prompt": [{"content": DAPO_TEMPLATE.format(q=f"What is {i} + {2 * i + 1}?"),
                                           "role": "user"}],
                               "label": str(3 * i + 1), "metadata": {"source": "dapo"}}
        if i % 2 == 0:
            row["instance_id"] = 100 + i
        rows.append(row)
    return rows


@pytest.fixture()
def client(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=30) as c:
        yield c


def template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def test_dapo_shaped_lines_render_their_message_list_exactly(client: httpx.Client, rollout_engine: Any,
                                                             qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                             tmp_path: Path) -> None:
    rows = dapo_rows(6)
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, repeats=2, **SLIME_DAPO_KEYS)
    records = drain(client, run_id, 12)
    ids = [str(100 + i) if i % 2 == 0 else str(i) for i in range(6)]
    groups = assert_whole_groups(records, instance_ids=ids, epochs=1, repeats=2)
    for (_, instance_id), members in groups.items():
        row = rows[ids.index(instance_id)]
        for record in members:
            assert_exact_turns(record)
            assert record["messages"][0] == row["prompt"][0], "the chat prompt is used as given, no instruction added"
            assert record["turns"][0]["prompt_ids"] == template(qwen_tokenizer, row["prompt"])
            predicted = record["extra_info"]["predicted"]
            assert record["raw_reward"] == (1.0 if predicted == row["label"] else 0.0)
            assert record["status"] == "completed" and record["tools"] is None


def test_custom_keys_and_tools_per_line(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str,
                                        qwen_tokenizer: Any, tmp_path: Path) -> None:
    rows = [{"question": f"What is {i} * 3?", "gold": str(3 * i), "extra_tools": json.dumps([WEATHER_TOOL]),
             "prompt": "a field this run does not read"} for i in range(3)]
    path = write_rows(tmp_path, rows)
    keys = {"input_key": "question", "label_key": "gold", "tool_key": "extra_tools"}
    math_run = start_native(client, path, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                            repeats=1, **keys)
    from rollout_buffer.tasks.builtin.math_generator import INSTRUCTION

    for record in drain(client, math_run, 3):
        row = rows[int(record["instance_id"])]
        user = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
        assert record["tools"] == [WEATHER_TOOL], "the line's tools were rendered and recorded"
        assert record["turns"][0]["prompt_ids"] == template(qwen_tokenizer, user, [WEATHER_TOOL])
        assert record["extra_info"]["label"] == row["gold"]
    calc_run = start_native(client, path, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                            task_type="calculator", repeats=1, **keys)
    for record in drain(client, calc_run, 3):
        assert [t["function"]["name"] for t in record["tools"]] == ["calculator", "get_weather"]
        assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert record["reward"] == 1.0, "the calculator answers right; the label came from the custom key"
        assert_exact_turns(record)


def test_a_file_the_task_cannot_read_is_refused_at_start(client: httpx.Client, rollout_engine: Any,
                                                         qwen_tokenizer_path: str, tmp_path: Path) -> None:
    def start(rows: list[dict[str, Any]], run_id: str, **extra: Any) -> httpx.Response:
        body = {"task_type": "math", "input_file": str(write_rows(tmp_path, rows, f"{run_id}.jsonl")),
                "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path, "run_id": run_id,
                **extra}
        return client.post("/start_rollout", json=body)

    before = client.get("/runs").json()
    rows = dapo_rows(3)
    answer = start(rows, "refused-default-key", input_key="input", label_key="label")  # slime's default --input-key
    assert answer.status_code == 400
    message = answer.json()["message"]
    assert "line 1" in message and "'input' (input_key): missing" in message and "'prompt'" in message, message
    rows[1]["label"] = None
    answer = start(rows, "refused-label", **SLIME_DAPO_KEYS)
    assert answer.status_code == 400 and "line 2: field 'label' (label_key): missing" in answer.json()["message"]
    rows = dapo_rows(2) + [{"prompt": [{"role": "user"}], "label": "1"}]
    answer = start(rows, "refused-message", **SLIME_DAPO_KEYS)
    assert answer.status_code == 400 and "line 3: field 'prompt' (input_key): message 0 (user) has no" \
        in answer.json()["message"]
    answer = start(dapo_rows(2) + [{"prompt": "x", "label": "1", "tools": "{"}], "refused-tools")
    assert answer.status_code == 400 and "line 3: field 'tools' (tool_key)" in answer.json()["message"]
    answer = start(dapo_rows(2), "refused-setting", input_key=["prompt"])
    assert answer.status_code == 400 and answer.json()["errors"][0]["field"] == "input_key"
    for run_id in ("refused-default-key", "refused-label", "refused-message", "refused-tools", "refused-setting"):
        assert client.get(f"/runs/{run_id}").status_code == 404, "a refused start stores no run"
    assert client.get("/runs").json() == before, "nothing stored, the active run unchanged"


def test_a_run_started_inactive_leaves_the_active_run_alone(client: httpx.Client, rollout_engine: Any,
                                                            qwen_tokenizer_path: str, tmp_path: Path) -> None:
    path = write_rows(tmp_path, dapo_rows(2))
    active = start_native(client, path, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                          repeats=1, **SLIME_DAPO_KEYS)
    assert client.get("/runs").json()["active_run"] == active
    side = start_native(client, path, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                        repeats=1, activate=False, **SLIME_DAPO_KEYS)
    assert client.get("/runs").json()["active_run"] == active, "an inactive run is reached by its run_id only"
    assert len(drain(client, side, 2)) == 2
    assert len(drain(client, active, 2)) == 2


def test_the_task_sees_the_mapped_sample_and_the_raw_line(client: httpx.Client, rollout_engine: Any,
                                                          qwen_tokenizer_path: str, tmp_path: Path) -> None:
    line = {"instance_id": 5, "q": "What is 1 + 1?", "gold": 2, "info": {"level": 3}, "fns": [WEATHER_TOOL],
            "prompt": "not the prompt of this run"}
    run_id = start_native(client, write_rows(tmp_path, [line]), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, task_type="echo_line", repeats=1, input_key="q",
                          label_key="gold", metadata_key="info", tool_key="fns")
    (record,) = drain(client, run_id, 1)
    info = record["extra_info"]
    assert info["sample"] == {"instance_id": "5", "prompt": "What is 1 + 1?", "label": 2, "metadata": {"level": 3},
                              "tools": [WEATHER_TOOL]}
    assert info["line"] == {**line, "instance_id": "5"}, "ctx.line is the line as read (id as text)"
    assert set(info["sample_keys"]) >= {"q", "gold", "info", "fns"}, "the raw keys stay in the sample"


def test_a_bad_line_after_the_checked_ones_fails_its_rollouts_only(client: httpx.Client, rollout_engine: Any,
                                                                   qwen_tokenizer_path: str, tmp_path: Path) -> None:
    from rollout_buffer.tasks.contract import VALIDATE_LINES

    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(VALIDATE_LINES)]
    rows.append({"prompt": "What is 5 + 5?"})  # no label: past the lines checked at start
    run_id = start_native(client, write_rows(tmp_path, rows), engine_url=rollout_engine.url,
                          tokenizer_path=qwen_tokenizer_path, repeats=1, num_process=64)
    records = {r["instance_id"]: r for r in drain(client, run_id, VALIDATE_LINES)}
    assert str(VALIDATE_LINES) not in records, "its group failed entirely and was filtered"
    detail = client.get(f"/runs/{run_id}").json()
    assert detail["failures"]["by_type"]["InvalidSample"]["count"] == 1
    assert "label: missing" in detail["failures"]["by_type"]["InvalidSample"]["example"]
