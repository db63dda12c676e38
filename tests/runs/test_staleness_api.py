"""Staleness at hand-over over HTTP, with records written by the test (a run of the `external` task):
the trainer's policy version from `/start_rollout`, reads and `POST /policy_version`; `drop` and `keep`
runs; `meta_info.staleness` and the run's counters (histogram, kept groups) counted once per batch."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl


@pytest.fixture()
def client(external_buffer: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=external_buffer.url, timeout=30) as c:
        yield c


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(4)])


def new_run(client: httpx.Client, input_file: Path, **extra: Any) -> str:
    return start_run(client, input_file, task_type="external", run_id=f"st-{uuid.uuid4().hex[:8]}", **extra)


def write(client: httpx.Client, run_id: str, iid: str, versions: list[Any], **extra: Any) -> None:
    for version in versions:
        turn = {"prompt_ids": [1, 2], "output_ids": [3], "output_logprobs": [-0.5], "weight_version": version}
        answer = client.post("/buffer/write", json=make_record(iid, run_id=run_id, turns=[turn], **extra))
        assert answer.json()["success"], answer.text


def stats(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return client.get(f"/runs/{run_id}").json()["stats"]


def test_staleness_is_measured_against_the_trainers_version(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, policy_version="4")
    write(client, run_id, "i0", ["4", 3])  # SGLang's digit strings count as versions
    write(client, run_id, "i1", ["default", "default"])  # no version: not measured
    read = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    meta = read["data"]["meta_info"]
    assert meta["policy_version"] == 4, "the version /start_rollout gave"
    assert meta["staleness"] == {"min": 0, "mean": 0.5, "max": 1, "over_bound": 0}
    assert meta["staleness_samples"] == 2 and meta["max_staleness"] is None
    assert [r["policy_version"] for r in read["data"]["data"] if r["instance_id"] == "i0"] == [None, None], \
        "records keep what was written; the version is derived from their turns"
    counters = stats(client, run_id)
    assert counters["staleness_hist:0"] == 1 and counters["staleness_hist:1"] == 1
    assert client.post("/policy_version", json={"run_id": run_id, "version": 6}).json()["data"]["previous"] == 4
    write(client, run_id, "i2", [5, 5])
    meta = client.post("/get_rollout_data", json={"run_id": run_id}).json()["data"]["meta_info"]
    assert meta["policy_version"] == 6 and meta["staleness"]["max"] == 1
    empty = client.post("/get_rollout_data", json={"run_id": run_id, "policy_version": 7}).json()
    assert not empty["success"] and client.get(f"/runs/{run_id}").json()["meta"]["policy_version"] == "7"


def test_a_drop_run_never_hands_over_stale_groups(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, max_staleness="1", stale_policy="drop")
    write(client, run_id, "i0", [1, 1])
    write(client, run_id, "i1", [2, 3])
    write(client, run_id, "i2", [0, 3])  # one old member makes the group old
    read = client.post("/get_rollout_data", json={"run_id": run_id, "policy_version": 3}).json()
    meta = read["data"]["meta_info"]
    assert meta["finished_groups"] == ["i1"] and {r["instance_id"] for r in read["data"]["data"]} == {"i1"}
    assert sorted(meta["stale_dropped_groups"]) == ["0:i0", "0:i2"] and meta["stale_requeued_groups"] == []
    assert meta["staleness"]["max"] == 1 and meta["stale_totals"]["stale_dropped_groups"] == 2
    counters = stats(client, run_id)
    assert counters["stale_dropped_groups"] == 2 and counters["stale_dropped_samples"] == 4
    late = client.post("/buffer/write", json=make_record("i0", run_id=run_id))
    assert late.status_code == 409, "a dropped group stays closed"


def test_a_keep_run_hands_stale_groups_over_and_counts_them_once(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, max_staleness="0", stale_policy="keep")
    write(client, run_id, "i0", [1, 2])
    write(client, run_id, "i1", [2, 2])
    body = {"run_id": run_id, "policy_version": 2, "lease_s": 60, "batch_id": "k1"}
    first = client.post("/get_rollout_data", json=body).json()["data"]["meta_info"]
    assert first["finished_groups"] == ["i0", "i1"]
    assert first["staleness"] == {"min": 0, "mean": 0.25, "max": 1, "over_bound": 1}
    retry = client.post("/get_rollout_data", json=body).json()["data"]["meta_info"]
    assert retry["retry"] and retry["staleness"] == first["staleness"]
    assert "stale_kept_groups" not in stats(client, run_id), "counted when the batch is acknowledged"
    assert client.post("/ack", json={"run_id": run_id, "batch_id": "k1"}).json()["success"]
    counters = stats(client, run_id)
    assert counters["stale_kept_groups"] == 1 and counters["staleness_hist:0"] == 3
    assert counters["staleness_hist:1"] == 1 and counters["groups_consumed"] == 2


def test_policy_version_route_refusals(client: httpx.Client, input_file: Path) -> None:
    assert client.post("/policy_version", json={"run_id": "nope-x", "version": 1}).status_code == 404
    run_id = new_run(client, input_file)
    no_engine = client.post("/policy_version", json={"run_id": run_id, "version": 1, "abort_in_flight": True})
    assert no_engine.status_code == 422 and "remote_engine_url" in no_engine.json()["message"]
    assert client.post("/policy_version", json={"run_id": run_id, "version": -1}).status_code == 422
    unreachable = new_run(client, input_file, remote_engine_url="http://127.0.0.1:9")
    answer = client.post("/policy_version", json={"run_id": unreachable, "version": 2, "abort_in_flight": True})
    assert answer.status_code == 502 and "set to 2" in answer.json()["message"]
    assert client.get(f"/runs/{unreachable}").json()["meta"]["policy_version"] == "2"


def test_a_slime_style_runs_filtered_groups_are_counted_not_replaced(client: httpx.Client,
                                                                    input_file: Path) -> None:
    run_id = new_run(client, input_file, group_filter="nonzero_std")
    write(client, run_id, "i0", [None, None])  # rewards 1.0 and 1.0
    write(client, run_id, "i1", [None, None], reward=0.0)
    read = client.post("/get_rollout_data", json={"run_id": run_id}).json()
    meta = read["data"]["meta_info"]
    assert sorted(meta["filtered_groups"]) == ["i0", "i1"] and meta["dynamic_filter"] == {"zero_std": 2}
    assert read["data"]["data"] == [] and read["success"], "consumed, nothing to train on"
    counters = stats(client, run_id)
    assert counters["drop:zero_std"] == 2 and counters["groups_filtered"] == 2
    assert "groups_extended" not in counters, "a slime-style module writes what it writes"

