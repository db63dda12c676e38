"""The adapter against slime's current argument names and defaults (`slime/utils/arguments.py`,
`slime/utils/eval_config.py`): buffer URL, dataset keys, sampling extras, reward normalisation, the batch
collection ratio, the failed-group limit, eval datasets, and slime's output classes."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from slime_adapter.hooks.evaluation import (
    EvalDataset,
    dataset_result,
    eval_datasets,
    eval_metrics,
    eval_run_id,
    start_payload,
)
from slime_adapter.hooks.outputs import eval_output, slime_outputs_available, train_output
from slime_adapter.reading.buffer_client import build_start_payload
from slime_adapter.reading.run_health import RunHealth, describe_run, exhausted_reason
from slime_adapter.settings import AgentRolloutSettings
from tests.support.slime_namespace import DAPO_OVERRIDES, install_slime_base_types, slime_namespace


def settings_of(**overrides: Any) -> AgentRolloutSettings:
    return AgentRolloutSettings.from_args(slime_namespace(**overrides))


def test_slimes_defaults_read_as_slime_means_them() -> None:
    settings = settings_of(rollout_buffer_url="http://buffer:8889/", prompt_data="/d.jsonl")
    assert settings.buffer_url == "http://buffer:8889"
    assert settings.input_keys == {"input_key": "input", "label_key": None, "metadata_key": "metadata",
                                   "tool_key": "tools"}
    assert settings.top_k is None and settings.stop is None, "top_k -1 is slime's 'off'"
    assert settings.disable_rewards_normalization is False and settings.min_batch_collection_ratio == 1.0
    assert settings.min_groups_per_step == 1 and settings.max_failed_groups == 8
    payload = build_start_payload(settings, {})
    assert (payload["input_key"], payload["label_key"], payload["tool_key"]) == ("input", None, "tools")
    assert payload["sampling_params"] == {"temperature": 1.0, "top_p": 1.0}


def test_dapo_keys_sampling_extras_and_qwen3_5_pass_through() -> None:
    settings = settings_of(**DAPO_OVERRIDES, prompt_data="/dapo.jsonl", rollout_top_k=20, rollout_stop=["</answer>"],
                           rollout_stop_token_ids=[151645], loss_mask_type="qwen3_5", rollout_batch_size=32,
                           rewards_normalization=False)
    payload = build_start_payload(settings, {"0": ["a"]})
    assert {k: payload[k] for k in ("input_key", "label_key", "metadata_key", "tool_key")} == \
        {"input_key": "prompt", "label_key": "label", "metadata_key": "metadata", "tool_key": None}
    assert payload["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 20, "stop": ["</answer>"],
                                          "stop_token_ids": [151645]}
    assert settings.loss_mask_type == "qwen3_5", "slime's --loss-mask-type choice is passed through as given"
    assert settings.disable_rewards_normalization is True, "--disable-rewards-normalization stores False"
    assert settings.reward_field(True) == "raw_reward"
    assert settings.max_failed_groups == 32, "default: one step's worth of groups, at least 8"


def test_batch_collection_ratio_and_failed_group_limit() -> None:
    assert settings_of(rollout_batch_size=10, min_batch_collection_ratio=0.25).min_groups_per_step == 3
    assert settings_of(rollout_batch_size=4, min_batch_collection_ratio=0.5).min_groups_per_step == 2
    assert settings_of(rollout_batch_size=4, min_batch_collection_ratio=0.01).min_groups_per_step == 1
    for ratio in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="min_batch_collection_ratio"):
            settings_of(min_batch_collection_ratio=ratio)
    assert settings_of(agent_max_consecutive_failed_groups=0).max_failed_groups == 0
    with pytest.raises(ValueError, match="agent_max_consecutive_failed_groups"):
        settings_of(agent_max_consecutive_failed_groups=-2)


def test_failed_group_streaks_and_exhausted_runs() -> None:
    health = RunHealth()
    health.observe({"finished_groups": ["a", "b", "c"], "failed_groups": ["b", "c"]})
    assert health.streak == 2
    health.observe({"finished_groups": ["a", "a"], "failed_groups": ["a"]})
    assert health.streak == 0, "same instance in two epochs: the second group succeeded"
    health.observe({"finished_groups": ["d"], "failed_groups": ["d"]})
    assert health.streak == 1
    native_done = {"meta": {"status": "finished", "enqueue_done": "1"}, "groups": {"ready": 0}}
    assert "every rollout task has ended" in (exhausted_reason(native_done) or "")
    assert exhausted_reason({**native_done, "groups": {"ready": 2}}) is None, "ready groups are still to read"
    assert exhausted_reason({"meta": {"status": "finished"}, "groups": {"ready": 0}}) is None, \
        "a legacy run's records may come from outside writers"
    assert exhausted_reason({"meta": {"status": "running", "enqueue_done": "1"}, "groups": {"ready": 0}}) is None
    assert "status 'failed'" in (exhausted_reason({"meta": {"status": "failed"}, "groups": {}}) or "")
    assert "does not know the run" in (exhausted_reason({"missing": True}) or "")
    assert "deleted" in (exhausted_reason({"meta": {"status": "deleted"}, "groups": {"ready": 0}}) or "")
    text = describe_run({"tasks": {"done": 1, "failed": 5}, "failures": {
        "by_type": {"EngineError": {"count": 5}}, "first_error": {"type": "EngineError", "uid": "r:0:a:0",
                                                                  "message": "HTTP 500"}}})
    assert "1 done, 5 failed" in text and "EngineError x5" in text and "(EngineError, r:0:a:0): HTTP 500" in text


@dataclass
class EvalDatasetConfig:
    """The fields of slime's `EvalDatasetConfig` the adapter reads (resolved as `build_eval_dataset_configs`
    leaves them: None where neither the dataset nor the defaults set a value)."""

    name: str
    path: str
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None


def test_eval_datasets_from_slimes_flat_list_and_configs() -> None:
    args = slime_namespace(**DAPO_OVERRIDES, eval_prompt_data=["aime", "/aime.jsonl", "gsm", "/gsm.jsonl"],
                           n_samples_per_eval_prompt=4, eval_temperature=0.6, rollout_top_p=0.9,
                           rollout_max_response_len=1024, eval_max_response_len=2048, eval_label_key="answer",
                           eval_top_k=3)
    aime, gsm = eval_datasets(args)
    assert (aime.name, aime.path, gsm.name) == ("aime", "/aime.jsonl", "gsm")
    assert (aime.n_samples, aime.temperature, aime.top_p, aime.max_response_len) == (4, 0.6, 0.9, 2048)
    assert aime.top_k == 3 and eval_datasets(slime_namespace(eval_prompt_data=["a", "/a"]))[0].top_k is None
    assert aime.input_keys == {"input_key": "prompt", "label_key": "answer", "metadata_key": "metadata",
                               "tool_key": None}, "eval_label_key wins, the rest falls back to the training keys"
    assert [d.name for d in eval_datasets(slime_namespace(eval_prompt_data=["/only.jsonl"]))] == ["aime"]
    with pytest.raises(ValueError, match="name/path pairs"):
        eval_datasets(slime_namespace(eval_prompt_data=["a", "/a", "b"]))
    assert eval_datasets(slime_namespace()) == []
    configured = slime_namespace(**DAPO_OVERRIDES, eval_prompt_data=["math500", "/m.jsonl"], eval_datasets=[
        EvalDatasetConfig("math500", "/m.jsonl", input_key="problem", label_key="solution", n_samples_per_eval_prompt=2,
                          temperature=0.0, top_k=5, stop=["<|im_end|>"], min_new_tokens=3)])
    (math500,) = eval_datasets(configured)
    assert math500.input_keys["input_key"] == "problem" and math500.input_keys["label_key"] == "solution"
    assert (math500.n_samples, math500.temperature, math500.top_k, math500.min_new_tokens) == (2, 0.0, 5, 3)
    payload = start_payload(AgentRolloutSettings.from_args(configured), math500, "eval-math500-3-x0", "math")
    assert payload["activate"] is False and payload["run_id"] == "eval-math500-3-x0"
    assert (payload["input_file"], payload["num_epoch"], payload["num_repeat_per_sample"]) == ("/m.jsonl", "1", "2")
    assert payload["sampling_params"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 5, "stop": ["<|im_end|>"],
                                          "min_new_tokens": 3}
    assert payload["skip_instance_ids"] == [] and payload["input_key"] == "problem"
    assert eval_run_id("my set/v2", 7).startswith("eval-my_set_v2-7-")
    assert eval_run_id("a", 1) != eval_run_id("a", 1), "every evaluation is a run of its own"


def test_eval_metrics_use_slimes_names() -> None:
    data = {"aime": {"rewards": [1.0, 0.0, 0.0, 1.0], "truncated": [False, True, False, False], "samples": []}}
    metrics = eval_metrics(data, {"aime": {"samples": 4, "groups": 2, "filtered_groups": 1, "failed_samples": 2,
                                           "unbuilt_samples": 0}})
    assert metrics["eval/aime"] == 0.5 and metrics["eval/aime-truncated_ratio"] == 0.25
    assert metrics["eval/aime/filtered_groups"] == 1 and metrics["eval/aime/failed_samples"] == 2
    assert isinstance(EvalDataset("n", "p").input_keys, dict)


@pytest.fixture()
def slime_base_types(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install_slime_base_types(monkeypatch)


def test_outputs_are_plain_without_slime_and_slimes_classes_with_it(slime_base_types: types.ModuleType,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert slime_outputs_available()
    wrapped = train_output([["s"]], {"rollout/x": 1})
    assert isinstance(wrapped, slime_base_types.RolloutFnTrainOutput) and wrapped.samples == [["s"]]
    assert wrapped.metrics == {"rollout/x": 1}
    evaluated = eval_output({"aime": {"rewards": [1.0]}}, {"eval/aime": 1.0})
    assert isinstance(evaluated, slime_base_types.RolloutFnEvalOutput) and evaluated.metrics == {"eval/aime": 1.0}
    monkeypatch.setitem(sys.modules, "slime.rollout.base_types", None)  # an older slime without base_types
    assert not slime_outputs_available()
    assert train_output([["s"]], {"m": 1}) == [["s"]] and eval_output({"a": {}}, None) == {"a": {}}


def test_eval_results_keep_raw_rewards_in_id_order_and_count_what_is_missing() -> None:
    def record(instance_id: str, repeat: int, reward: float, status: str = "completed") -> dict[str, Any]:
        return {"uid": f"eval-x:0:{instance_id}:{repeat}", "instance_id": instance_id, "repeat": repeat, "epoch": 0,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "reward": reward - 0.5, "raw_reward": reward, "status": status, "extra_info": {}}

    records = [record("10", 1, 0.0, "truncated"), record("10", 0, 1.0), record("9", 0, 1.0), record("9", 1, 0.0, "failed")]
    metas = [{"finished_groups": ["10", "3"], "filtered_groups": ["3"], "status_counts": {"failed": 2}},
             {"finished_groups": ["9"], "filtered_groups": [], "status_counts": {"failed": 1, "completed": 1}}]
    settings = settings_of(hf_checkpoint=None)  # no tokenizer: the samples are kept without tokens, counted
    entry, counts = dataset_result(settings, "x", records, metas)
    assert [s.metadata["uid"] for s in entry["samples"]] == ["eval-x:0:9:0", "eval-x:0:9:1", "eval-x:0:10:0",
                                                              "eval-x:0:10:1"]
    assert entry["rewards"] == [1.0, 0.0, 1.0, 0.0], "raw rewards, never the normalised ones"
    assert entry["truncated"] == [False, False, False, True]
    assert counts == {"samples": 4, "groups": 2, "unbuilt_samples": 4, "filtered_groups": 1, "failed_samples": 3}
    assert all(s.metadata["build_error"].startswith("ValueError") for s in entry["samples"])
