"""Every Sample field slime's trainer reads, on Samples built from runtime records (the buffer's workers
on the SGLang test engine, replay fields asked for as slime asks), checked against slime's rules as facts
(`tests/support/slime_fields.py`); FAILED status, `remove_sample` and `train_metadata` from records."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_buffer.runtime.records import failure_record
from slime_adapter.hooks.agent_rollout import generate_rollout
from slime_adapter.samples.build import build_samples
from slime_adapter.samples.sample import Sample
from tests.support.helpers import ServerProcess, make_record, write_jsonl
from tests.support.slime_fields import check_sample_fields
from tests.support.slime_namespace import slime_namespace

GROUP = 2
MOE = (2, 2, 8)  # layers, topk, experts of the test engine
TOOL_S = 0.3


@pytest.fixture()
def replay_engine(rollout_engine: Any) -> Iterator[Any]:
    rollout_engine.configure(weight_version="v7", spec_draft_tokens=3, routed_experts_from_cache=True,
                             moe_layers=MOE[0], moe_topk=MOE[1], moe_experts=MOE[2])
    yield rollout_engine
    rollout_engine.configure(weight_version="default", spec_draft_tokens=0, routed_experts_from_cache=False)


def fields_args(buffer: ServerProcess, engine: Any, tokenizer_path: str, prompt_data: Path, **extra: Any) -> Any:
    values: dict[str, Any] = {
        "rollout_buffer_url": buffer.url, "engine_url": engine.url, "prompt_data": str(prompt_data),
        "hf_checkpoint": tokenizer_path, "n_samples_per_prompt": GROUP, "rollout_batch_size": 2, "num_epoch": 1,
        "rollout_task_type": "slime_fields", "rollout_max_response_len": 64, "rollout_num_process": 8,
        "rollout_top_p": 0.9, "use_rollout_routing_replay": True, "num_layers": MOE[0], "moe_router_topk": MOE[1],
        "agent_fetch_timeout_s": 10.0, "agent_fetch_backoff_s": 0.05, "fetch_trajectory_retry_times": 20,
        "agent_rollout_run_id": f"fields-{time.monotonic_ns()}", **extra,
    }
    return slime_namespace(**values)


def test_runtime_records_fill_every_field_slime_reads(runtime_server: ServerProcess, replay_engine: Any,
                                                      qwen_tokenizer_path: str, tmp_path: Path) -> None:
    rows = [{"instance_id": f"f{i}", "prompt": f"Compute {i} * 7 with the tool.", "turns": 2, "tool_s": TOOL_S,
             "extra_info": {"train_metadata": {"loss": "sft", "weight": 0.5}}} for i in range(2)]
    args = fields_args(runtime_server, replay_engine, qwen_tokenizer_path, write_jsonl(tmp_path / "f.jsonl", rows))
    from tests.support.helpers import SlimeLikeDataBuffer

    groups = generate_rollout(args, 0, SlimeLikeDataBuffer())
    samples = [s for group in groups for s in group]
    assert len(samples) == 2 * GROUP
    for sample in samples:
        assert sample.metadata["mask_source"] == "tokens"
        check_sample_fields(sample, engine_version="v7", calls=2, spec_draft=3, moe=MOE,
                            vocab=replay_engine.codec.vocab_size, min_tool_s=TOOL_S)
        assert sample.train_metadata == {"loss": "sft", "weight": 0.5}
        assert sample.remove_sample is False and sample.status == Sample.Status.COMPLETED
    ids = [s.rollout_id for s in samples]
    assert len(set(ids)) == len(ids), "one rollout id per record"


def test_forks_of_one_record_share_its_rollout_id(qwen_tokenizer: Any) -> None:
    first = {"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.1, -0.2], "finish_reason": "stop",
             "weight_version": 0, "calls": [{"weight_version": "v1", "prompt_tokens": 3, "cached_tokens": 0}]}
    drifted = {"prompt_ids": [1, 2, 9, 9], "output_ids": [6], "output_logprobs": [-0.3], "finish_reason": "stop",
               "weight_version": 1, "calls": [{"weight_version": "v2", "prompt_tokens": 4, "cached_tokens": 2}]}
    record = make_record("x", turns=[first, drifted], session_id="gw-session-1")
    samples, stats = build_samples(record, lambda: qwen_tokenizer, fork_policy="all", rollout_id=41)
    assert stats.forks == 1 and [s.rollout_id for s in samples] == [41, 41]
    assert [s.weight_versions for s in samples] == [["v1"], ["v2"]], "each piece: its own calls' versions"
    assert [s.metadata["policy_versions"] for s in samples] == [[0], [1]]
    assert all(s.session_id == "gw-session-1" for s in samples), "a record's session id wins over its uid"
    assert samples[1].prefix_cache_info.cached_tokens == 2 and samples[1].prefix_cache_info.total_prompt_tokens == 4


def test_failed_records_and_extra_info_flags(qwen_tokenizer: Any) -> None:
    failed = failure_record(RuntimeError("tool server down"), uid="u1", instance_id="3", epoch=0, repeat=0,
                            attempt=0, messages=[{"role": "user", "content": "hi"}], tools=None, duration_s=1.0)
    [sample], _ = build_samples(failed, lambda: qwen_tokenizer)
    assert sample.status == Sample.Status.FAILED and sample.metadata["error_type"] == "RuntimeError"
    flagged = make_record("4", extra_info={"remove_sample": True, "train_metadata": {"teacher": "t1"}},
                          non_generation_time=2.5)
    [sample], _ = build_samples(flagged, lambda: qwen_tokenizer)
    assert sample.remove_sample is True and sample.train_metadata == {"teacher": "t1"}
    assert sample.non_generation_time == 2.5


def test_partial_rollout_marks_records_continued_across_an_update(external_buffer: ServerProcess,
                                                                  tmp_path: Path) -> None:
    """slime's `--partial-rollout`: a sample continued across a weight update carries `start_rollout_id` (the
    version it started under); `--mask-offpolicy-in-partial-rollout` masks what the older version generated."""
    import httpx

    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
    from tests.support.helpers import SlimeLikeDataBuffer

    run_id = f"partial-{time.monotonic_ns()}"
    args = slime_namespace(
        rollout_buffer_url=external_buffer.url, rollout_task_type="external", n_samples_per_prompt=2,
        prompt_data=str(write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "p0", "prompt": "x"}])),
        rollout_batch_size=1, num_epoch=1, hf_checkpoint=str(qwen_tokenizer_dir("qwen2.5")),
        agent_rollout_run_id=run_id, agent_fetch_timeout_s=2.0, agent_fetch_backoff_s=0.05,
        fetch_trajectory_retry_times=3, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    from slime_adapter.reading.buffer_client import start_rollout

    start_rollout(external_buffer.url, args, {})
    turn = {"prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6], "output_logprobs": [-0.1, -0.2, -0.3],
            "finish_reason": "stop", "weight_version": 3, "version_spans": [[3, 2], [4, 1]],
            "calls": [{"weight_version": "v3"}, {"weight_version": "v4"}]}
    steady = {**turn, "version_spans": None, "weight_version": 4, "calls": [{"weight_version": "v4"}]}
    with httpx.Client(base_url=external_buffer.url, timeout=10) as client:
        for uid, record_turn in (("a", turn), ("b", steady)):
            record = make_record("p0", uid=f"{run_id}:{uid}", run_id=run_id, turns=[record_turn])
            assert client.post("/buffer/write", json=record).status_code == 200
    [group] = generate_rollout(args, 5, SlimeLikeDataBuffer())
    continued, fresh = sorted(group, key=lambda s: s.metadata["uid"])
    assert continued.metadata["start_rollout_id"] == 3 and "start_rollout_id" not in fresh.metadata
    assert continued.weight_versions == ["v3", "v4"], "one per engine call, as slime appends them"
    assert continued.loss_mask == [0, 0, 1] and fresh.loss_mask == [1, 1, 1]
