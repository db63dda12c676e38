"""`generate_rollout` as slime calls it, with slime's own argument namespace and data shapes, against a real
buffer running the built-in tasks on the SGLang test engine: dapo-shaped files, custom keys with tools per
line, a file the task cannot read, a run whose rollouts all fail, and evaluation."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.tasks.builtin.math_generator import INSTRUCTION
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from slime_adapter.hooks.agent_rollout import (
    RolloutDataUnavailable,
    RunFailedError,
    StartRolloutRejected,
    generate_rollout,
    get_state,
    start_rollout,
)
from slime_adapter.samples.sample import Sample
from tests.adapter.test_slime_inputs_e2e import WEATHER_TOOL, dapo_rows
from tests.support.helpers import ServerProcess, SlimeLikeDataBuffer, write_jsonl
from tests.support.slime_namespace import DAPO_OVERRIDES, install_slime_base_types, slime_namespace

GROUP = 2


def dapo_args(buffer: ServerProcess, engine: Any, tokenizer_path: str, prompt_data: Path, **extra: Any) -> Any:
    values: dict[str, Any] = {
        **DAPO_OVERRIDES, "rollout_buffer_url": buffer.url, "engine_url": engine.url, "prompt_data": str(prompt_data),
        "hf_checkpoint": tokenizer_path, "n_samples_per_prompt": GROUP, "rollout_batch_size": 2, "num_epoch": 1,
        "rollout_max_response_len": 256, "rollout_num_process": 16, "agent_fetch_timeout_s": 5.0,
        "agent_fetch_backoff_s": 0.05, "agent_rollout_run_id": f"train-{time.monotonic_ns()}",
    }
    values.update(extra)
    return slime_namespace(**values)


def prompt_tokens(sample: Any) -> list[int]:
    return list(sample.tokens[:len(sample.tokens) - sample.response_length])


def template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def check_token_path(sample: Any) -> None:
    assert sample.metadata["mask_source"] == "tokens"
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs) > 0
    assert all(math.isfinite(x) and x <= 0 for x in sample.rollout_log_probs)


def test_dapo_shaped_prompts_give_token_exact_samples(runtime_server: ServerProcess, rollout_engine: Any,
                                                      qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                      tmp_path: Path) -> None:
    rows = dapo_rows(4)
    args = dapo_args(runtime_server, rollout_engine, qwen_tokenizer_path, write_jsonl(tmp_path / "dapo.jsonl", rows))
    buffer = SlimeLikeDataBuffer()
    ids = {str(100 + i) if i % 2 == 0 else str(i): row for i, row in enumerate(rows)}  # int ids, and none
    seen: list[str] = []
    for step in range(2):
        groups = generate_rollout(args, step, buffer)
        assert len(groups) == 2 and all(len(g) == GROUP for g in groups)
        for group in groups:
            row = ids[group[0].metadata["instance_id"]]
            seen.append(group[0].metadata["instance_id"])
            for sample in group:
                check_token_path(sample)
                assert prompt_tokens(sample) == template(qwen_tokenizer, row["prompt"]), "the line's own chat prompt"
                raw = sample.metadata["raw_reward"]
                assert raw == (1.0 if sample.metadata["predicted"] == row["label"] else 0.0)
    assert sorted(seen) == sorted(ids)
    assert buffer.metadata == {"0": {"groups": [f"0:{i}" for i in seen[:2]]}, "1": {"groups": [f"0:{i}" for i in seen[2:]]}}


def test_custom_keys_and_tools_per_line_reach_the_prompt(runtime_server: ServerProcess, rollout_engine: Any,
                                                         qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                         tmp_path: Path) -> None:
    rows = [{"id": i, "question": f"What is {i} + 10?", "gold": str(i + 10), "tools": json.dumps([WEATHER_TOOL])}
            for i in range(2)]
    for row in rows:
        row["instance_id"] = row.pop("id")
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    args = dapo_args(runtime_server, rollout_engine, qwen_tokenizer_path, path, input_key="question",
                     label_key="gold", tool_key="tools", metadata_key="metadata", rollout_batch_size=2)
    groups = generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert sorted(g[0].metadata["instance_id"] for g in groups) == ["0", "1"]
    for group in groups:
        row = rows[int(group[0].metadata["instance_id"])]
        for sample in group:
            check_token_path(sample)
            user = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
            assert prompt_tokens(sample) == template(qwen_tokenizer, user, [WEATHER_TOOL])
            assert sample.metadata["label"] == row["gold"]


def test_a_file_the_task_cannot_read_is_refused_before_anything_is_stored(runtime_server: ServerProcess,
                                                                          rollout_engine: Any,
                                                                          qwen_tokenizer_path: str,
                                                                          tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dapo.jsonl", dapo_rows(3))
    runs_before = httpx.get(f"{runtime_server.url}/runs", timeout=30).json()
    args = dapo_args(runtime_server, rollout_engine, qwen_tokenizer_path, path, input_key="input",
                     agent_start_rollout_attempts=1)  # slime's default --input-key, not this file's key
    with pytest.raises(StartRolloutRejected, match=r"line 1: field 'input' \(input_key\): missing") as caught:
        generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert caught.value.status_code == 400
    assert httpx.get(f"{runtime_server.url}/runs", timeout=30).json() == runs_before, "no run stored"


@pytest.fixture()
def failing_engine() -> Iterator[Any]:
    from rollout_buffer.testing.engine import run_engine_in_thread

    with run_engine_in_thread(template="qwen2.5", seed=5, error_rate=1.0) as engine:
        yield engine


def test_a_run_of_only_failing_rollouts_ends_with_a_clear_error(runtime_server: ServerProcess, failing_engine: Any,
                                                                qwen_tokenizer_path: str, tmp_path: Path) -> None:
    args = dapo_args(runtime_server, failing_engine, qwen_tokenizer_path, write_jsonl(tmp_path / "d.jsonl", dapo_rows(3)),
                     agent_fetch_timeout_s=3.0, fetch_trajectory_retry_times=-1)  # -1: the case that polled forever
    body = {"task_type": "math", "input_file": args.prompt_data, "num_repeat_per_sample": GROUP, "num_epoch": 1,
            "remote_engine_url": failing_engine.url, "tokenizer_path": qwen_tokenizer_path, "engine_retries": 0,
            "run_id": args.agent_rollout_run_id, **{k: DAPO_OVERRIDES[k] for k in ("input_key", "label_key", "tool_key")}}
    started = httpx.post(f"{runtime_server.url}/start_rollout", json=body, timeout=30)
    assert started.status_code == 200  # no engine retries
    began = time.monotonic()
    with pytest.raises(RunFailedError) as caught:
        generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert time.monotonic() - began < 60
    message = str(caught.value)
    assert args.agent_rollout_run_id in message and "can hand over nothing more" in message
    assert "0 done, 6 failed" in message and "EngineError x6" in message and "first error (EngineError" in message
    assert "HTTP 500" in message
    assert caught.value.run_id == get_state().run_id == args.agent_rollout_run_id


def write_group(url: str, run_id: str, instance_id: str, status: str = "completed") -> None:
    from tests.support.helpers import make_record

    with httpx.Client(base_url=url, timeout=10) as client:
        for repeat in range(GROUP):
            record = make_record(instance_id, uid=f"{run_id}:{instance_id}:{repeat}", run_id=run_id, status=status,
                                 reward=0.0 if status == "failed" else 1.0)
            assert client.post("/buffer/write", json=record).status_code == 200


def external_args(buffer: ServerProcess, tmp_path: Path, run_id: str, **extra: Any) -> Any:
    path = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(8)])
    values = {"rollout_buffer_url": buffer.url, "rollout_task_type": "external", "prompt_data": str(path),
              "n_samples_per_prompt": GROUP, "rollout_batch_size": 4, "num_epoch": 1,
              "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")),
              "agent_rollout_run_id": run_id, "agent_fetch_timeout_s": 2.0, "agent_fetch_backoff_s": 0.05,
              "fetch_trajectory_retry_times": 1, **extra}
    return slime_namespace(**values)


def test_consecutive_all_failed_groups_stop_the_step(external_buffer: ServerProcess, tmp_path: Path) -> None:
    args = external_args(external_buffer, tmp_path, "streak", agent_max_consecutive_failed_groups=3,
                         rollout_batch_size=8, fetch_trajectory_retry_times=-1)
    buffer = SlimeLikeDataBuffer()
    assert start_rollout(external_buffer.url, args, {})["run_id"] == "streak"  # the run exists before the writes
    for instance_id, status in (("i0", "failed"), ("i1", "completed"), ("i2", "failed"), ("i3", "failed"),
                                ("i4", "failed")):
        write_group(external_buffer.url, "streak", instance_id, status)
    with pytest.raises(RunFailedError, match=r"the last 3 group\(s\) of run streak failed entirely"):
        generate_rollout(args, 0, buffer)
    assert buffer.metadata["0"] == {"groups": [f"0:i{i}" for i in range(5)]}, "what was consumed is recorded for resume"


def test_min_batch_collection_ratio_returns_a_partial_step(external_buffer: ServerProcess, tmp_path: Path) -> None:
    args = external_args(external_buffer, tmp_path, "ratio", min_batch_collection_ratio=0.5)
    assert start_rollout(external_buffer.url, args, {})["run_id"] == "ratio"
    write_group(external_buffer.url, "ratio", "i0")
    write_group(external_buffer.url, "ratio", "i1")
    write_group(external_buffer.url, "ratio", "i2")
    groups = generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert [g[0].metadata["instance_id"] for g in groups] == ["i0", "i1", "i2"], \
        "ceil(0.5 * 4) = 2 groups in hand and nothing more ready: the step returns the 3 it has"
    write_group(external_buffer.url, "ratio", "i3")
    with pytest.raises(RolloutDataUnavailable):  # 1 group < 2: the step waits (and gives up after its retries)
        generate_rollout(args, 1, SlimeLikeDataBuffer())
    full = external_args(external_buffer, tmp_path, "ratio", min_batch_collection_ratio=1.0)
    kept = SlimeLikeDataBuffer()
    for instance_id in ("i4", "i5", "i6"):
        write_group(external_buffer.url, "ratio", instance_id)
    with pytest.raises(RolloutDataUnavailable):  # slime's default ratio 1 waits for all 4 groups
        generate_rollout(full, 2, kept)
    assert kept.get_buffer_length() == 3, "what was read stays in slime's data buffer"
    write_group(external_buffer.url, "ratio", "i7")
    groups = generate_rollout(full, 3, kept)
    assert [g[0].metadata["instance_id"] for g in groups] == ["i4", "i5", "i6", "i7"]


def eval_rows(n: int) -> list[dict[str, Any]]:
    return [{"problem": f"What is {i} * 4?", "solution": str(4 * i)} for i in range(n)]  # no ids: line numbers


def test_evaluation_returns_slimes_shape_and_leaves_training_alone(runtime_server: ServerProcess,
                                                                   rollout_engine: Any, qwen_tokenizer_path: str,
                                                                   tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="slime_adapter.hooks.evaluation")
    train = write_jsonl(tmp_path / "train.jsonl", dapo_rows(6))
    aime = write_jsonl(tmp_path / "aime.jsonl", [{**row, "instance_id": 10 - i} for i, row in enumerate(dapo_rows(3))])
    qa = write_jsonl(tmp_path / "qa.jsonl", eval_rows(11))

    class EvalDatasetConfig:  # slime's dataclass, as slime_validate_args resolves it for these two datasets
        def __init__(self, name: str, path: Path, **fields: Any) -> None:
            self.name, self.path = name, str(path)
            for key in ("input_key", "label_key", "tool_key", "metadata_key", "n_samples_per_eval_prompt",
                        "temperature", "top_p", "top_k", "max_response_len", "stop", "stop_token_ids"):
                setattr(self, key, fields.get(key))

    args = dapo_args(runtime_server, rollout_engine, qwen_tokenizer_path, train, n_samples_per_eval_prompt=2,
                     eval_prompt_data=["aime", str(aime), "qa", str(qa)], eval_max_response_len=128,
                     eval_datasets=[EvalDatasetConfig("aime", aime, input_key="prompt", label_key="label"),
                                    EvalDatasetConfig("qa", qa, input_key="problem", label_key="solution",
                                                      n_samples_per_eval_prompt=3, temperature=0.7)])
    buffer = SlimeLikeDataBuffer()
    first = generate_rollout(args, 0, buffer)
    train_run = get_state().run_id
    with httpx.Client(base_url=runtime_server.url, timeout=30) as client:
        handed_before = client.get(f"/runs/{train_run}").json()["groups"]["consumed"]
        result = generate_rollout(args, 0, buffer, evaluation=True)
        runs = client.get("/runs").json()
        assert runs["active_run"] == train_run, "evaluation never becomes the active run"
        assert client.get(f"/runs/{train_run}").json()["groups"]["consumed"] == handed_before, \
            "no training group was read by the evaluation"
        eval_runs = [r for r in runs["runs"] if r.startswith("eval-")]
        configs = {r: client.get(f"/runs/{r}").json()["config"] for r in eval_runs}
    assert set(result) == {"aime", "qa"}
    aime_entry, qa_entry = result["aime"], result["qa"]
    assert set(aime_entry) == {"rewards", "truncated", "samples"}
    assert len(aime_entry["rewards"]) == len(aime_entry["truncated"]) == len(aime_entry["samples"]) == 3 * 2
    assert len(qa_entry["rewards"]) == 11 * 3, "qa's own n_samples_per_eval_prompt"
    assert [s.metadata["instance_id"] for s in aime_entry["samples"]] == ["8", "8", "9", "9", "10", "10"]
    assert [s.metadata["instance_id"] for s in qa_entry["samples"][::3]] == [str(i) for i in range(11)], \
        "natural id order: line numbers 0..10, not '0', '1', '10', '2'"
    for entry in (aime_entry, qa_entry):
        for reward, truncated, sample in zip(entry["rewards"], entry["truncated"], entry["samples"]):
            assert reward in (0.0, 1.0) and reward == sample.reward == sample.metadata["raw_reward"], "raw rewards"
            assert truncated == (sample.status == Sample.Status.TRUNCATED)
            check_token_path(sample)
    assert 0.0 < sum(qa_entry["rewards"]) < len(qa_entry["rewards"]), "raw 0/1 rewards, never GRPO-normalised"
    ours = {c["input_file"]: c for c in configs.values() if c["input_file"] in (str(aime), str(qa))}
    assert len(ours) == 2 and all(c["activate"] is False and c["num_epoch"] == 1 for c in ours.values())
    assert ours[str(qa)]["sampling_params"]["temperature"] == 0.7 and ours[str(qa)]["num_repeat_per_sample"] == 3
    assert ours[str(aime)]["sampling_params"]["max_tokens"] == 128, "eval_max_response_len"
    assert "eval 0:" in caplog.text and "'eval/aime'" in caplog.text and "'eval/qa-truncated_ratio'" in caplog.text
    second = generate_rollout(args, 1, buffer)
    train_ids = {g[0].metadata["instance_id"] for g in first + second}
    assert len(train_ids) == 4 and train_ids <= {"100", "1", "102", "3", "104", "5"}, "training carries on alone"


def test_with_slimes_output_classes_metrics_go_to_slime(external_buffer: ServerProcess, runtime_server: ServerProcess,
                                                        rollout_engine: Any, qwen_tokenizer_path: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    base_types = install_slime_base_types(monkeypatch)
    args = external_args(external_buffer, tmp_path, "wrapped", rollout_batch_size=2, use_wandb=True)
    assert start_rollout(external_buffer.url, args, {})["run_id"] == "wrapped"
    write_group(external_buffer.url, "wrapped", "i0")
    write_group(external_buffer.url, "wrapped", "i1", status="failed")
    write_group(external_buffer.url, "wrapped", "i2")
    output = generate_rollout(args, 4, SlimeLikeDataBuffer())
    assert isinstance(output, base_types.RolloutFnTrainOutput)
    assert [g[0].metadata["instance_id"] for g in output.samples] == ["i0", "i2"]
    assert output.metrics["rollout/no_filter/total_samples"] == 6 and output.metrics["rollout/filtered_groups"] == 1
    assert wandb.run is None, "slime logs the returned metrics; the adapter does not log them to wandb again"
    tiny = write_jsonl(tmp_path / "tiny.jsonl", eval_rows(2))
    eval_args = dapo_args(runtime_server, rollout_engine, qwen_tokenizer_path, tiny, use_wandb=True,
                          eval_prompt_data=["tiny", str(tiny)], eval_input_key="problem", eval_label_key="solution")
    result = generate_rollout(eval_args, 4, SlimeLikeDataBuffer(), evaluation=True)
    assert isinstance(result, base_types.RolloutFnEvalOutput) and list(result.data) == ["tiny"]
    assert len(result.data["tiny"]["rewards"]) == 2 and result.metrics["eval/tiny/samples"] == 2
    assert result.metrics["eval/tiny"] == sum(result.data["tiny"]["rewards"]) / 2 and result.metrics["eval/step"] == 4
    assert wandb.run is None
