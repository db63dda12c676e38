"""The tier that runs against slime itself: `SLIME_DIR` names a checkout of slime's repository (slime is
not on PyPI), `torch` is a minimal stand-in where slime imports it (`tests/support/torch_standin.py`).
Without `SLIME_DIR` these tests are skipped with that reason; `test_slime_fields.py` and
`test_dynamic_filter.py` check the same fields and rules from slime's source as facts.

- Samples from runtime records are slime's own `Sample`, pass its own length checks, and equal what
  slime's `Sample.append_response_tokens` makes of the same engine calls;
- slime's `check_reward_nonzero_std`, named by `--dynamic-sampling-filter-path`, drops exactly the
  zero-std groups, counted as slime counts them;
- slime's own buffer client (`slime_plugins/rollout_buffer/rollout_buffer_example.py`) trains from
  `rollout-buffer serve` unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from slime_adapter.hooks.agent_rollout import generate_rollout, reset_state
from slime_adapter.reading.buffer_client import start_rollout
from slime_adapter.samples.build import build_group_samples
from tests.adapter.test_dynamic_filter import args_for, write_groups
from tests.adapter.test_slime_fields import GROUP, MOE, TOOL_S, fields_args, replay_engine  # noqa: F401
from tests.support.helpers import ServerProcess, SlimeLikeDataBuffer, write_jsonl
from tests.support.slime_fields import check_sample_fields
from tests.support.slime_namespace import slime_namespace
from tests.support.torch_standin import real_slime


@pytest.fixture()
def slime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """slime's modules from `$SLIME_DIR` (skipped without it), with a fresh adapter state."""
    reset_state()
    yield from real_slime(monkeypatch)
    reset_state()


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"instance_id": f"r{i}", "prompt": f"Compute {i} * 9 with the tool.", "turns": 2, "tool_s": TOOL_S,
             "extra_info": {"train_metadata": {"loss": "sft"}}} for i in range(n)]


def test_samples_are_slimes_own_and_pass_its_checks(slime: Any, runtime_server: ServerProcess, replay_engine: Any,
                                                     qwen_tokenizer_path: str, tmp_path: Path) -> None:
    args = fields_args(runtime_server, replay_engine, qwen_tokenizer_path, write_jsonl(tmp_path / "r.jsonl", _rows(2)))
    output = generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert isinstance(output, slime.base_types.RolloutFnTrainOutput), "slime's own output class"
    samples = [s for group in output.samples for s in group]
    assert len(samples) == 2 * GROUP
    for sample in samples:
        assert type(sample) is slime.Sample
        check_sample_fields(sample, engine_version="v7", calls=2, spec_draft=3, moe=MOE,
                            vocab=replay_engine.codec.vocab_size, min_tool_s=TOOL_S)
        sample._validate_response_metadata_lengths()  # slime's own consistency checks
        again = slime.Sample.from_dict(sample.to_dict())
        assert again.prefix_cache_info.to_dict() == sample.prefix_cache_info.to_dict()
        assert sample.train_metadata == {"loss": "sft"}


def _read_records(url: str, run_id: str, count: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while len(records) < count and time.monotonic() < deadline:
        body = httpx.post(f"{url}/get_rollout_data", json={"run_id": run_id, "wait_s": 2.0}, timeout=30).json()
        records.extend(body["data"]["data"])
    assert len(records) == count, f"{len(records)} of {count} records within 60 s"
    return records


def _slime_reference(Sample: Any, record: dict[str, Any]) -> Any:
    """What slime's own `Sample.append_response_tokens` makes of the record's engine calls."""
    args = SimpleNamespace(num_layers=MOE[0], moe_router_topk=MOE[1], sglang_speculative_algorithm="EAGLE")
    turns = record["turns"]
    sample = Sample(tokens=list(turns[0]["prompt_ids"]))
    for j, turn in enumerate(turns):
        if j:
            sample.append_response_tokens(args, tokens=turn["prompt_ids"][len(sample.tokens):], trainable=False)
        [call] = turn["calls"]
        meta = {**call, "finish_reason": {"type": turn["finish_reason"]},
                "routed_experts": turn["routed_experts"], "routed_experts_start_len": turn["routed_experts_start_len"],
                "top_p_token_ids": turn["top_p_token_ids"], "top_p_token_offsets": turn["top_p_token_offsets"]}
        sample.append_response_tokens(args, tokens=turn["output_ids"], log_probs=turn["output_logprobs"],
                                      trainable=True, meta_info=meta)
    return sample


def test_samples_equal_what_slime_builds_from_the_same_engine_calls(slime: Any, runtime_server: ServerProcess,
                                                                    replay_engine: Any, qwen_tokenizer_path: str,
                                                                    tmp_path: Path) -> None:
    args = fields_args(runtime_server, replay_engine, qwen_tokenizer_path, write_jsonl(tmp_path / "r.jsonl", _rows(2)))
    run_id = start_rollout(runtime_server.url, args, {})["run_id"]
    records = _read_records(runtime_server.url, run_id, 2 * GROUP)
    samples, _ = build_group_samples(records, lambda: None, moe_shape=MOE[:2], first_rollout_id=0)
    for record, ours in zip(records, samples):
        ref = _slime_reference(slime.Sample, orjson.loads(orjson.dumps(record)))
        assert ours.tokens == ref.tokens and ours.loss_mask == ref.loss_mask
        assert np.allclose(ours.rollout_log_probs, ref.rollout_log_probs)
        assert ours.weight_versions == ref.weight_versions == ["v7", "v7"]
        assert ours.prefix_cache_info.to_dict() == ref.prefix_cache_info.to_dict()
        assert ours.spec_info.to_dict() == ref.spec_info.to_dict()
        assert np.array_equal(np.asarray(ours.rollout_routed_experts), np.asarray(ref.rollout_routed_experts))
        assert list(ours.rollout_top_p_token_ids) == list(np.asarray(ref.rollout_top_p_token_ids))
        assert list(ours.rollout_top_p_token_offsets) == list(np.asarray(ref.rollout_top_p_token_offsets))
        assert ours.status == ref.status


def test_slimes_own_nonzero_std_filter_by_its_path(slime: Any, external_buffer: ServerProcess, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import slime_adapter.hooks.agent_rollout as agent

    run_id = f"real-dyn-{time.monotonic_ns()}"
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    args = args_for(external_buffer, tmp_path, run_id, dynamic_sampling_filter_path=path, reward_key=None)
    start_rollout(external_buffer.url, args, {})
    write_groups(external_buffer.url, run_id, ["i0", "i1", "i2", "i3"])
    metrics: list[dict[str, Any]] = []
    real_log = agent.log_raw_info
    monkeypatch.setattr(agent, "log_raw_info", lambda *a, **k: metrics.append(real_log(*a, **k)) or metrics[-1])
    output = generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert [g[0].metadata["instance_id"] for g in output.samples] == ["i1"]
    assert metrics[0]["rollout/dynamic_filter/drop_zero_std_0.0"] == 1
    assert metrics[0]["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
    assert output.metrics["rollout/dynamic_filter/drop_zero_std_0.0"] == 1, "handed to slime with its output"


class _DataBuffer(SlimeLikeDataBuffer):
    """slime's data source as its own buffer client calls it (metadata lists of instance ids)."""


def test_slimes_own_buffer_client_trains_from_the_server(slime: Any, runtime_server: ServerProcess,
                                                         rollout_engine: Any, qwen_tokenizer_path: str,
                                                         tmp_path: Path) -> None:
    from slime_plugins.rollout_buffer import rollout_buffer_example as example

    rows = [{"instance_id": str(i), "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(2)]
    args = slime_namespace(
        rollout_buffer_url=runtime_server.url, engine_url=rollout_engine.url, rollout_task_type="math",
        prompt_data=str(write_jsonl(tmp_path / "math.jsonl", rows)), hf_checkpoint=qwen_tokenizer_path,
        n_samples_per_prompt=GROUP, rollout_batch_size=2, num_epoch=1, rollout_max_response_len=64,
        rollout_num_process=8, fetch_trajectory_retry_times=5, loss_mask_type="qwen", use_wandb=False,
        use_tensorboard=False)
    buffer = _DataBuffer()
    groups = asyncio.run(asyncio.wait_for(example.generate_rollout_async(args, 0, buffer), timeout=120))
    assert len(groups) == 2 and all(len(g) == GROUP for g in groups)
    for sample in (s for g in groups for s in g):
        assert type(sample) is slime.Sample
        assert len(sample.loss_mask) == sample.response_length > 0 and 1 in sample.loss_mask
    assert sorted(buffer.metadata["0"]) == ["0", "1"], "slime's client records the finished groups it read"
