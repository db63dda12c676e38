"""The trainer side end to end: slime's `generate_rollout` against a real buffer running the built-in
`math` task on the SGLang test engine, two steps, then a resume after the buffer restarts."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from slime_adapter.hooks.agent_rollout import generate_rollout, get_state, reset_state
from slime_adapter.samples.sample import Sample
from tests.support.helpers import ServerProcess, write_jsonl

ROWS = [{"instance_id": f"q{i}", "prompt": f"What is {i} + {2 * i + 1}?", "label": str(3 * i + 1)} for i in range(12)]
GROUP = 4
BATCH = 3


@pytest.fixture()
def adapter() -> Iterator[None]:
    reset_state()
    yield
    reset_state()


def slime_args(buffer_url: str, engine_url: str, input_file: Path, tokenizer_path: str) -> SimpleNamespace:
    engine = urlparse(engine_url)
    return SimpleNamespace(
        agent_rollout_buffer_url=buffer_url, rollout_task_type="math", prompt_data=str(input_file),
        n_samples_per_prompt=GROUP, rollout_batch_size=BATCH, num_epoch=1, rollout_num_process=16,
        hf_checkpoint=tokenizer_path, loss_mask_type="qwen", rollout_max_response_len=256,
        rollout_temperature=1.0, rollout_top_p=1.0, sglang_router_ip=engine.hostname,
        sglang_router_port=engine.port, agent_fetch_timeout_s=10.0, fetch_trajectory_retry_times=5,
        agent_fetch_backoff_s=0.1, use_wandb=False,
    )


def check_group(group: list[Any], tokenizer: Any) -> str:
    """Invariants of one group built on the token path; returns its instance id."""
    assert len(group) == GROUP
    instance_id = group[0].metadata["instance_id"]
    row = next(r for r in ROWS if r["instance_id"] == instance_id)
    for sample in group:
        assert sample.metadata["instance_id"] == instance_id and sample.group_index == group[0].group_index
        assert sample.metadata["mask_source"] == "tokens", "math records carry the engine's tokens"
        assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
        assert sample.response_length > 0 and all(sample.loss_mask), "single turn: every response token sampled"
        assert all(math.isfinite(x) and x <= 0 for x in sample.rollout_log_probs)
        prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
        user = [{"role": "user", "content": row["prompt"] + "\n" + sample_instruction()}]
        assert prompt == tokenizer.apply_chat_template(user, tokenize=True, return_dict=False, add_generation_prompt=True)
        assert sample.status == Sample.Status.COMPLETED and sample.metadata["raw_reward"] in (0.0, 1.0)
    raw = [s.metadata["raw_reward"] for s in group]
    if len(set(raw)) > 1:
        assert sum(s.reward for s in group) == pytest.approx(0.0, abs=1e-4), "GRPO-normalised rewards"
    else:
        assert all(s.reward == 0.0 for s in group)
    return instance_id


def sample_instruction() -> str:
    from rollout_buffer.tasks.builtin.math_generator import INSTRUCTION

    return INSTRUCTION


def wait_all_rolled_out(url: str, run_id: str, expected: int, timeout_s: float = 60.0) -> None:
    """Stop the first buffer only when no rollout is in flight (an in-flight task would wait for its lease)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            detail = client.get(f"/runs/{run_id}").json()
            if detail["tasks"]["done"] + detail["tasks"]["failed"] >= expected:
                return
            assert time.monotonic() < deadline, f"rollouts not finished within {timeout_s}s: {detail['tasks']}"
            time.sleep(0.1)


def test_two_steps_then_resume_after_a_buffer_restart(
        tmp_path: Path, adapter: None, rollout_engine: Any, qwen_tokenizer_path: str, qwen_tokenizer: Any,
        slime_data_buffer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="slime_adapter.hooks.metrics")
    input_file = write_jsonl(tmp_path / "math.jsonl", ROWS)
    data_dir = tmp_path / "data"
    first = ServerProcess(data_dir).start()
    try:
        args = slime_args(first.url, rollout_engine.url, input_file, qwen_tokenizer_path)
        buffer = slime_data_buffer()
        step0 = generate_rollout(args, 0, buffer)
        assert get_state().start_answer["created"] is True
        run_id = get_state().run_id
        saved = copy.deepcopy(buffer.get_metadata())
        step1 = generate_rollout(args, 1, buffer)
        ids0 = [check_group(g, qwen_tokenizer) for g in step0]
        ids1 = [check_group(g, qwen_tokenizer) for g in step1]
        assert len(step0) == len(step1) == BATCH and not set(ids0) & set(ids1)
        keys0, keys1 = [f"0:{i}" for i in ids0], [f"0:{i}" for i in ids1]
        assert saved == {"0": {"groups": keys0}} and buffer.metadata == {"0": {"groups": keys0}, "1": {"groups": keys1}}
        assert "rollout 1:" in caplog.text and "rollout/response_len/mean" in caplog.text
        wait_all_rolled_out(first.url, run_id, len(ROWS) * GROUP)
    finally:
        first.stop()

    reset_state()  # a new trainer process resuming from the checkpoint of step 0
    with ServerProcess(data_dir) as second:
        args = slime_args(second.url, rollout_engine.url, input_file, qwen_tokenizer_path)
        resumed_buffer = slime_data_buffer(saved)
        resumed = generate_rollout(args, 1, resumed_buffer)
        answer = get_state().start_answer
        # step 1's batch was never acknowledged (its ack rides on the next read, which never came): its lease
        # survived the buffer's restart and the resumed trainer's start released it, so the same run goes on
        # and the resumed step 1 trains exactly those groups; nothing is rolled out again
        assert answer["run_id"] == run_id and answer["created"] is False
        assert answer["skipped_instance_ids"] == len(ids0)
        ids = [check_group(g, qwen_tokenizer) for g in resumed]
        assert sorted(ids) == sorted(ids1), "the released batch is handed over again, first"
        detail = httpx.get(f"{second.url}/runs/{run_id}", timeout=30).json()
        # step 1 read its groups in one batch or two, as they were ready
        assert detail["meta"]["status"] != "superseded" and detail["leases"]["lease_released"] >= 1
        for step in range(2, len(ROWS) // BATCH):
            ids += [check_group(g, qwen_tokenizer) for g in generate_rollout(args, step, resumed_buffer)]
        assert not set(ids) & set(ids0), "what step 0 trained is never handed out again"
        assert sorted(ids) == sorted(r["instance_id"] for r in ROWS if r["instance_id"] not in ids0), \
            "everything not trained is handed over once"
        assert resumed_buffer.metadata["0"] == {"groups": keys0}
