"""Bounded staleness and group filters end to end: slime's `generate_rollout` against a real buffer with
in-process workers on the SGLang test engine (real HTTP, real Redis, the real Qwen tokenizer).

* a trainer bumping its policy version every step never gets a sample staler than `max_staleness`, the
  admission rule holds at every step, and the share of generation thrown away is reported;
* `POST /policy_version` with `abort_in_flight` interrupts a multi-turn rollout: its record keeps the
  version of every turn, and the interrupted turn's versions per token;
* `group_filter: nonzero_std` (DAPO) drops all-equal groups, counts them by reason and still fills every
  step, from the prompt stream past the planned epochs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime_adapter.hooks.agent_rollout import generate_rollout, get_state, reset_state
from slime_adapter.samples.build import build_samples
from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import arithmetic_rows, run_detail, start_native, wait_status, write_rows
from tests.support.slime_namespace import install_slime_base_types, slime_namespace

GROUP = 2


@pytest.fixture()
def adapter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    install_slime_base_types(monkeypatch)  # generate_rollout returns (samples, metrics)
    reset_state()
    yield
    reset_state()


@pytest.fixture()
def client(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=60) as c:
        yield c


@pytest.fixture()
def engine(rollout_engine: Any) -> Iterator[Any]:
    yield rollout_engine
    rollout_engine.configure(latency_s=0.0, latency_jitter_s=0.0)


def trainer_args(server: ServerProcess, engine: Any, input_file: Path, tokenizer_path: str, *, task: str,
                 batch: int, **extra: Any) -> Any:
    return slime_namespace(
        rollout_buffer_url=server.url, engine_url=engine.url, rollout_task_type=task, prompt_data=str(input_file),
        n_samples_per_prompt=GROUP, rollout_batch_size=batch, num_epoch=1, rollout_num_process=8,
        hf_checkpoint=tokenizer_path, rollout_max_response_len=128, agent_fetch_timeout_s=20.0,
        agent_fetch_backoff_s=0.05, agent_rollout_run_id=f"{task}-{uuid.uuid4().hex[:8]}", input_key="prompt",
        label_key="label", **extra)


def test_a_trainer_bumping_its_version_gets_nothing_staler_than_the_bound(
        tmp_path: Path, adapter: None, runtime_server: ServerProcess, client: httpx.Client, engine: Any,
        qwen_tokenizer_path: str, slime_data_buffer: Any) -> None:
    engine.configure(latency_s=0.02, latency_jitter_s=0.5)  # rollouts finish out of the order they started
    batch, steps = 2, 6
    input_file = write_rows(tmp_path, arithmetic_rows(batch * steps))
    args = trainer_args(runtime_server, engine, input_file, qwen_tokenizer_path, task="math", batch=batch,
                        agent_max_staleness=1)
    buffer = slime_data_buffer()
    last: dict[str, Any] = {}
    seen: set[str] = set()
    for step in range(steps):
        output = generate_rollout(args, step, buffer)
        run_id = get_state().run_id
        assert len(output.samples) == batch, "every step is full"
        for group in output.samples:
            assert len(group) == GROUP
            for sample in group:
                versions = sample.metadata["policy_versions"]  # the buffer's counter per turn
                assert versions and step - min(versions) <= 1, (step, versions)
            seen.add(group[0].metadata["instance_id"])
        metrics = output.metrics
        assert metrics["rollout/staleness_max"] <= 1 and metrics["rollout/staleness_over_bound"] == 0
        assert 0 <= metrics["rollout/staleness_min"] <= metrics["rollout/staleness_mean"] <= 1
        first, second = run_detail(client, run_id), run_detail(client, run_id)
        started = first["stats"]["groups_started"]  # read before the snapshot it is compared with
        allowed = int(second["meta"]["consumed_before_version"]) + 2 * int(second["meta"]["groups_per_read"])
        assert started <= allowed, "admission: started and unconsumed <= (max_staleness + 1) x groups per read"
        assert int(second["meta"]["groups_per_read"]) == batch
        last = metrics
    assert len(seen) == batch * steps, "every prompt handed over once"
    stats = run_detail(client, run_id)["stats"]
    wasted = stats.get("stale_requeued_groups", 0) + stats.get("stale_dropped_groups", 0)
    share = wasted / stats["groups_started"]
    assert last["rollout/stale_requeued"] == pytest.approx(share)
    assert stats["groups_started"] == batch * steps + wasted, "each requeued group was started once more"
    # the measured share of generation thrown away; admission keeps it well below the whole
    print(f"wasted share with max_staleness=1: {share:.3f} ({wasted} of {stats['groups_started']} groups)")
    assert share < 0.5


def _wait_engine(engine: Any, requests: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (engine.stats_dict()["requests"] >= requests and engine.stats_dict()["in_flight"] >= 1):
        assert time.monotonic() < deadline, f"the engine never saw request {requests}: {engine.stats_dict()}"
        time.sleep(0.01)


def test_abort_in_flight_continues_under_the_new_version_and_keeps_both(
        tmp_path: Path, client: httpx.Client, engine: Any, qwen_tokenizer_path: str) -> None:
    engine.configure(latency_s=1.0)
    engine.reset_stats()
    input_file = write_rows(tmp_path, [{"instance_id": "m0", "prompt": "Count to three.", "turns": 3}])
    run_id = start_native(client, input_file, engine_url=engine.url, tokenizer_path=qwen_tokenizer_path,
                          task_type="multiturn", repeats=1, policy_version=0)
    _wait_engine(engine, requests=2)  # the second turn is being generated
    time.sleep(0.5)  # half of it: the engine has tokens to give back
    answer = client.post("/policy_version", json={"run_id": run_id, "version": 1, "abort_in_flight": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"] == {"run_id": run_id, "policy_version": 1, "previous": 0, "aborted": True,
                                     "engines": [{"url": f"{engine.url}/abort_request", "aborted": True}]}
    wait_status(client, run_id, "finished")
    read = client.post("/get_rollout_data", json={"run_id": run_id, "policy_version": 1}).json()
    [record] = read["data"]["data"]
    turns = record["turns"]
    assert [t["weight_version"] for t in turns] == [0, 0, 1], "each turn keeps the version it began under"
    assert [v for v, _ in turns[1]["version_spans"]] == [0, 1], "the interrupted turn: both, per token"
    assert sum(n for _, n in turns[1]["version_spans"]) == len(turns[1]["output_ids"])
    assert all("version_spans" not in t for t in (turns[0], turns[2]))
    assert record["policy_version"] == 0 and record["status"] == "completed"
    assert engine.stats_dict()["aborts"] == 1
    meta = read["data"]["meta_info"]
    assert meta["policy_version"] == 1 and meta["staleness"] == {"min": 1, "mean": 1.0, "max": 1, "over_bound": 0}
    # slime's --mask-offpolicy-in-partial-rollout: only what the newest version generated trains
    (plain,), _ = build_samples(record, lambda: None, "qwen")
    (masked,), stats = build_samples(record, lambda: None, "qwen", mask_offpolicy=True)
    old_tokens = len(turns[0]["output_ids"]) + turns[1]["version_spans"][0][1]
    assert sum(plain.loss_mask) - sum(masked.loss_mask) == old_tokens == stats.offpolicy_masked_tokens > 0
    assert masked.metadata["offpolicy_masked_tokens"] == old_tokens and masked.tokens == plain.tokens
    newest = turns[1]["version_spans"][1][1] + len(turns[2]["output_ids"])
    assert sum(masked.loss_mask) == newest, "the continued part of turn 2 and all of turn 3 train"


def test_nonzero_std_drops_all_equal_groups_and_keeps_every_step_full(
        tmp_path: Path, adapter: None, runtime_server: ServerProcess, client: httpx.Client, engine: Any,
        qwen_tokenizer_path: str, slime_data_buffer: Any) -> None:
    rows = [{"instance_id": f"p{i}", "prompt": f"p{i}", "rewards": [1, 1] if i % 3 == 0 else [1, 0]}
            for i in range(6)]  # p0 and p3: every sample right, nothing to learn
    input_file = write_rows(tmp_path, rows)
    args = trainer_args(runtime_server, engine, input_file, qwen_tokenizer_path, task="pattern", batch=2,
                        agent_group_filter="nonzero_std")
    buffer = slime_data_buffer()
    handed: list[tuple[Any, str]] = []
    dropped = 0
    for step in range(3):
        output = generate_rollout(args, step, buffer)
        assert len(output.samples) == 2, "a full step whatever the filter dropped"
        for group in output.samples:
            rewards = {s.metadata["raw_reward"] for s in group}
            assert len(rewards) == 2, "no all-equal group reaches the trainer"
            handed.append((group[0].metadata["epoch"], group[0].metadata["instance_id"]))
        dropped += output.metrics.get("rollout/dynamic_filter/drop_zero_std", 0)
    run_id = get_state().run_id
    # The plan's 4 good groups, then the prompt stream past epoch 0: p0 (dropped again), p1, p2.
    assert sorted(handed) == [(0, "p1"), (0, "p2"), (0, "p4"), (0, "p5"), (1, "p1"), (1, "p2")]
    assert dropped == 3
    detail = wait_status(client, run_id, "finished")
    stats = detail["stats"]
    assert stats["drop:zero_std"] == 3 and stats["groups_extended"] == 3 and stats["groups_filtered"] == 3
    assert detail["meta"]["epoch_limit"] == "2"
    extra = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    assert not extra["success"], "exactly lines x num_epoch groups passed the filter; nothing more"


def test_a_custom_group_filter_drops_by_its_own_reason(tmp_path: Path, client: httpx.Client, engine: Any,
                                                      qwen_tokenizer_path: str) -> None:
    rows = [{"instance_id": f"c{i}", "prompt": f"c{i}", "rewards": [1, 1] if i < 2 else [0, 1]} for i in range(4)]
    input_file = write_rows(tmp_path, rows)
    run_id = start_native(client, input_file, engine_url=engine.url, tokenizer_path=qwen_tokenizer_path,
                          task_type="pattern", group_filter="tests.support.group_filters.not_all_perfect",
                          max_extra_groups=0, policy_version="3")
    wait_status(client, run_id, "finished")
    read = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    meta = read["data"]["meta_info"]
    assert sorted(meta["finished_groups"]) == ["c0", "c1", "c2", "c3"]
    assert sorted(meta["filtered_groups"]) == ["c0", "c1"] and meta["dynamic_filter"] == {"all_perfect": 2}
    assert sorted({r["instance_id"] for r in read["data"]["data"]}) == ["c2", "c3"]
    assert {r["policy_version"] for r in read["data"]["data"]} == {3}, "no engine call: the version at its start"
    stats = run_detail(client, run_id)["stats"]
    assert stats["drop:all_perfect"] == 2 and "groups_extended" not in stats, "max_extra_groups=0: no replacement"


@pytest.mark.parametrize(("extra", "field", "words"), [
    ({"group_filter": "nonzero_std", "num_repeat_per_sample": "1"}, "group_filter", "groups of 2 or more"),
    ({"group_filter": "tests.support.group_filters.nope"}, "group_filter", "has no function 'nope'"),
    ({"group_filter": "no_such_module_here.f"}, "group_filter", "cannot import module"),
    ({"group_filter": "not a path"}, "group_filter", "dotted path"),
    ({"max_staleness": "-1"}, "max_staleness", ">= 0"),
    ({"max_staleness": "x"}, "max_staleness", "not a number"),
    ({"stale_policy": "later"}, "stale_policy", "requeue, drop, keep"),
    ({"max_staleness": "1", "task_type": "slime_style"}, "stale_policy", "only a native task"),
])
def test_unusable_staleness_and_filter_fields_are_refused(tmp_path: Path, client: httpx.Client, extra: dict[str, str],
                                                          field: str, words: str) -> None:
    input_file = write_rows(tmp_path, arithmetic_rows(2))
    body = {"task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": "2",
            "run_id": f"bad-{uuid.uuid4().hex[:6]}", **extra}
    answer = client.post("/start_rollout", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["errors"][0]["field"] == field and words in answer.json()["message"]
    assert client.get(f"/runs/{body['run_id']}").status_code == 404, "nothing stored"
