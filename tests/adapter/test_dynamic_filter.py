"""slime's dynamic sampling filter (`--dynamic-sampling-filter-path`) and `--over-sampling-batch-size` in
the adapter, against a real buffer: exactly the zero-std groups are dropped, counted under slime's metric
names; the surplus of an over-sampled read waits leased (its batch unacknowledged) for the next step, and
nothing is lost or trained twice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import slime_adapter.hooks.agent_rollout as agent
from slime_adapter.hooks.agent_rollout import generate_rollout, get_state, reset_state
from slime_adapter.hooks.dynamic_filter import Verdict, judge, should_drop
from slime_adapter.reading.buffer_client import start_rollout
from tests.support.helpers import ServerProcess, SlimeLikeDataBuffer, make_record, write_jsonl
from tests.support.slime_namespace import slime_namespace

GROUP = 2
FILTER = "tests.support.slime_fields.filter_nonzero_std"
REWARDS = {"i0": (0.0, 0.0), "i1": (0.0, 1.0), "i2": (1.0, 1.0), "i3": (1.0, 0.0), "i4": (0.0, 1.0), "i5": (1.0, 1.0)}


def write_groups(url: str, run_id: str, names: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        for name in names:
            for repeat, reward in enumerate(REWARDS[name]):
                record = make_record(name, uid=f"{run_id}:{name}:{repeat}", run_id=run_id, reward=reward)
                assert client.post("/buffer/write", json=record).status_code == 200


def args_for(buffer: ServerProcess, tmp_path: Path, run_id: str, **extra: Any) -> Any:
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    path = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": name, "prompt": name} for name in REWARDS])
    values = {"rollout_buffer_url": buffer.url, "rollout_task_type": "external", "prompt_data": str(path),
              "n_samples_per_prompt": GROUP, "rollout_batch_size": 1, "num_epoch": 1,
              "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "agent_rollout_run_id": run_id,
              "agent_fetch_timeout_s": 2.0, "agent_fetch_backoff_s": 0.05, "fetch_trajectory_retry_times": 3,
              "dynamic_sampling_filter_path": FILTER, "over_sampling_batch_size": 4, **extra}
    return slime_namespace(**values)


def leased_groups(url: str, run_id: str) -> int:
    return int(httpx.get(f"{url}/runs/{run_id}", timeout=10).json()["groups"]["leased"])


def test_zero_std_groups_dropped_and_the_surplus_waits_leased(external_buffer: ServerProcess, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = f"dyn-{time.monotonic_ns()}"
    args = args_for(external_buffer, tmp_path, run_id)
    buffer = SlimeLikeDataBuffer()
    start_rollout(external_buffer.url, args, {})
    write_groups(external_buffer.url, run_id, ["i0", "i1", "i2", "i3", "i4", "i5"])
    metrics: list[dict[str, Any]] = []
    real_log = agent.log_raw_info

    def capture(*a: Any, **k: Any) -> dict[str, Any]:
        metrics.append(real_log(*a, **k))
        return metrics[-1]

    monkeypatch.setattr(agent, "log_raw_info", capture)
    first = generate_rollout(args, 0, buffer)
    assert [g[0].metadata["instance_id"] for g in first] == ["i1"]
    assert metrics[0]["rollout/dynamic_filter/drop_zero_std_0.0"] == 1
    assert metrics[0]["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
    assert metrics[0]["rollout/dynamic_filter/dropped_groups"] == 2
    assert metrics[0]["rollout/over_sampling_held_groups"] == 1, "i3 waits for the next step"
    assert buffer.metadata["0"] == {"groups": ["0:i0", "0:i1", "0:i2"]}, "a held group is not consumed yet"
    assert leased_groups(external_buffer.url, run_id) == 4, "its batch stays leased, unacknowledged"
    reads = len(get_state().surplus.read_batches)
    assert reads == 1

    second = generate_rollout(args, 1, buffer)
    assert [g[0].metadata["instance_id"] for g in second] == ["i3"], "the held group comes first, no read"
    assert buffer.metadata["1"] == {"groups": ["0:i3"]}
    assert leased_groups(external_buffer.url, run_id) == 4, "this step trains its last group: acked with the next read"

    third = generate_rollout(args, 2, buffer)
    assert [g[0].metadata["instance_id"] for g in third] == ["i4"]
    acked = httpx.get(f"{external_buffer.url}/runs/{run_id}", timeout=10).json()["leases"]["batches_acked"]
    assert acked == 1, "the third step's read acknowledged the first batch, once nothing of it was held"
    assert metrics[-1]["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
    trained = [g[0].metadata["instance_id"] for step in (first, second, third) for g in step]
    assert trained == ["i1", "i3", "i4"], "every non-zero-std group once, none twice"
    consumed = [k for step in ("0", "1", "2") for k in buffer.metadata[step]["groups"]]
    assert sorted(consumed) == [f"0:i{i}" for i in range(6)] and len(set(consumed)) == 6


def test_held_surplus_is_renewed_and_a_trainer_that_dies_loses_nothing(external_buffer: ServerProcess, tmp_path: Path) -> None:
    run_id = f"dyn-die-{time.monotonic_ns()}"
    args = args_for(external_buffer, tmp_path, run_id, agent_lease_s=1.0)
    start_rollout(external_buffer.url, args, {})
    write_groups(external_buffer.url, run_id, ["i0", "i1", "i2", "i3"])
    first = generate_rollout(args, 0, SlimeLikeDataBuffer())
    assert [g[0].metadata["instance_id"] for g in first] == ["i1"]
    held_until = time.monotonic() + 2.5  # over twice the lease: renewed between steps while the trainer lives
    while time.monotonic() < held_until:
        assert leased_groups(external_buffer.url, run_id) == 4, "the held surplus's batch stays leased"
        time.sleep(0.2)
    reset_state()  # the trainer process is gone with i3 held; its lease runs out
    deadline = time.monotonic() + 20
    while leased_groups(external_buffer.url, run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    detail = httpx.get(f"{external_buffer.url}/runs/{run_id}", timeout=10).json()
    assert detail["groups"]["leased"] == 0 and detail["leases"]["lease_expired"] >= 1
    assert detail["groups"]["ready"] == 4, "the unacknowledged batch is back: i3 is not lost"


def test_filter_outputs_as_slime_reads_them() -> None:
    assert judge(None, None, []) == Verdict(keep=True)
    assert judge(lambda a, s: False, None, []) == Verdict(keep=False), "a plain bool (slime's legacy form)"
    soft = Verdict(keep=False, reason="zero_std_1.0", keep_when_insufficient=True)
    assert should_drop(soft, candidates=3, target=2) is True
    assert should_drop(soft, candidates=2, target=2) is False, "kept when dropping leaves too few"
    assert should_drop(Verdict(keep=False), candidates=1, target=2) is True
