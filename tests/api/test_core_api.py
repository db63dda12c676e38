"""The core service over real HTTP against a real Redis: embedded, a real 3-node Redis Cluster, and an
external one when REDIS_URL is set (tests/support/backends.py)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.backends import BACKENDS
from tests.support.helpers import ServerSpec, make_record, start_run, write_jsonl

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")


SERVER = ServerSpec(args=("--task-dir", TASKS), backends=tuple(BACKENDS))


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(8)])


def new_run(client: httpx.Client, input_file: Path, **extra: object) -> str:
    return start_run(client, input_file, task_type=extra.pop("task_type", "external"),  # type: ignore[arg-type]
                     run_id=f"t-{uuid.uuid4().hex[:10]}", **extra)


def write(client: httpx.Client, run_id: str, instance_id: str, **kw: object) -> httpx.Response:
    response = client.post("/buffer/write", json=make_record(instance_id, run_id=run_id, **kw))
    return response


def read(client: httpx.Client, run_id: str, **body: object) -> dict:
    response = client.post("/get_rollout_data", json={"run_id": run_id, **body})
    assert response.status_code == 200, response.text
    return response.json()


def run_stats(client: httpx.Client, run_id: str) -> dict:
    return client.get(f"/runs/{run_id}").json()


def test_groups_are_handed_over_whole_in_completion_order(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=3)
    write(client, run_id, "i0")
    write(client, run_id, "i1")
    assert not read(client, run_id)["success"], "no group is complete yet"
    for _ in range(2):
        assert write(client, run_id, "i1").json()["success"]
    write(client, run_id, "i0")
    last = write(client, run_id, "i0").json()
    assert last["data"]["group_completed"] is True
    answer = read(client, run_id)
    assert answer["success"]
    ids = [r["instance_id"] for r in answer["data"]["data"]]
    assert ids == ["i1"] * 3 + ["i0"] * 3
    meta = answer["data"]["meta_info"]
    assert meta["finished_groups"] == ["i1", "i0"]
    assert meta["total_samples"] == 6 and meta["num_groups"] == 2 and meta["avg_group_size"] == 3.0
    assert not read(client, run_id)["success"], "a group is handed over once"


def test_num_pages_whole_groups_in_order(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=3)
    for i in range(5):
        for _ in range(3):
            write(client, run_id, f"i{i}")
    pages = []
    while True:
        answer = read(client, run_id, num=7)
        if not answer["success"]:
            break
        assert len(answer["data"]["data"]) <= 7
        pages.append([r["instance_id"] for r in answer["data"]["data"]])
    assert [len(p) for p in pages] == [6, 6, 3]
    assert [x for p in pages for x in p] == [f"i{i}" for i in range(5) for _ in range(3)]


def test_num_smaller_than_a_group_says_so(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=3)
    for _ in range(3):
        write(client, run_id, "i0")
    answer = read(client, run_id, num=2)
    assert not answer["success"] and "smaller than the next ready group" in answer["message"]
    assert len(read(client, run_id, num=3)["data"]["data"]) == 3


def test_two_epochs_of_one_instance_stay_apart(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=2, epochs=2)
    write(client, run_id, "i0", epoch=1, reward=1.0)
    write(client, run_id, "i0", epoch=0, reward=0.0)
    write(client, run_id, "i0", epoch=1, reward=1.0)
    answer = read(client, run_id)
    assert [(r["epoch"], r["reward"]) for r in answer["data"]["data"]] == [(1, 1.0), (1, 1.0)]
    write(client, run_id, "i0", epoch=0, reward=0.0)
    assert [(r["epoch"], r["reward"]) for r in read(client, run_id)["data"]["data"]] == [(0, 0.0), (0, 0.0)]
    # records without an epoch fill the first open group of that instance
    run2 = new_run(client, input_file, repeats=2, epochs=2)
    for reward in (0.0, 0.0, 1.0, 1.0):
        write(client, run2, "i3", reward=reward)
    groups = read(client, run2)["data"]["data"]
    assert [(r["epoch"], r["reward"]) for r in groups] == [(0, 0.0), (0, 0.0), (1, 1.0), (1, 1.0)]
    assert write(client, run2, "i3").status_code == 409, "a third epoch does not exist"


def test_write_is_idempotent_by_uid(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=2)
    first = write(client, run_id, "i0", uid="same-uid")
    again = write(client, run_id, "i0", uid="same-uid")
    assert first.json()["message"] == "stored" and again.json()["message"].startswith("already stored")
    assert not read(client, run_id)["success"], "the duplicate must not complete the group"
    write(client, run_id, "i0")
    data = read(client, run_id)["data"]["data"]
    assert sorted(r["uid"] for r in data).count("same-uid") == 1 and len(data) == 2
    stats = run_stats(client, run_id)
    assert stats["records"]["duplicates"] == 1 and stats["records"]["written"] == 2


def test_skip_ids_are_not_stored_and_are_counted(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1, skip_instance_ids=["i1", 2])
    answer = write(client, run_id, "i1").json()
    assert answer["success"] is False and "skipped" in answer["message"]
    write(client, run_id, "i0")
    assert [r["instance_id"] for r in read(client, run_id)["data"]["data"]] == ["i0"]
    assert run_stats(client, run_id)["drops"]["skipped_group"] == 1


def test_group_hooks_filter_transform_and_meta(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, task_type="graded", repeats=2)
    for reward in (0.0, 0.0):
        write(client, run_id, "i0", reward=reward)
    for reward in (1.0, 3.0):
        write(client, run_id, "i1", reward=reward)
    answer = read(client, run_id)
    meta = answer["data"]["meta_info"]
    assert meta["finished_groups"] == ["i0", "i1"], "a filtered group is still reported as consumed"
    assert meta["filtered_groups"] == ["i0"] and meta["hook_groups"] == ["i0", "i1"]
    rewards = sorted((r["raw_reward"], round(r["reward"], 4)) for r in answer["data"]["data"])
    assert rewards == [(1.0, -1.0), (3.0, 1.0)]
    assert meta["avg_reward"] == 1.0, "meta_info is over everything written, before filtering"
    assert run_stats(client, run_id)["groups"]["filtered"] == 1


def test_long_poll_returns_when_a_group_completes(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    started = time.monotonic()
    assert not read(client, run_id, wait_s=0.3)["success"]
    assert time.monotonic() - started >= 0.25
    timer = threading.Timer(0.3, lambda: write(httpx.Client(base_url=str(client.base_url), timeout=30), run_id, "i5"))
    timer.start()
    started = time.monotonic()
    answer = read(client, run_id, wait_s=10)
    elapsed = time.monotonic() - started
    timer.join()
    assert answer["success"] and answer["data"]["data"][0]["instance_id"] == "i5"
    assert elapsed < 5, f"long poll waited {elapsed:.1f}s after the group completed"


def test_bad_input_is_refused_and_nothing_is_stored(client: httpx.Client, input_file: Path, tmp_path: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    base = make_record("i0", run_id=run_id)
    cases: list[tuple[dict, int, str]] = [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "malformed JSON"),
        ({"content": b"[1, 2]", "headers": {"content-type": "application/json"}}, 400, "JSON object"),
        ({"json": {k: v for k, v in base.items() if k != "reward"}}, 422, "reward"),
        ({"json": {k: v for k, v in base.items() if k != "uid"}}, 422, "uid"),
        ({"json": {**base, "reward": "high"}}, 422, "reward"),
        ({"json": {**base, "messages": "hello"}}, 422, "messages"),
        ({"json": {**base, "extra_info": [1]}}, 422, "extra_info"),
        ({"json": {**base, "status": "great"}}, 422, "status"),
        ({"json": {**base, "turns": [{"prompt_ids": [1], "output_ids": [2, 3], "output_logprobs": [-1.0]}]}},
         422, "output_logprobs"),
    ]
    for kwargs, status, needle in cases:
        response = client.post("/buffer/write", **kwargs)
        assert response.status_code == status, (kwargs, response.text)
        assert needle in response.json()["message"], response.text
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        raw = httpx.Request("POST", "/", json=base).content.replace(b'"reward":1.0', b'"reward":' + literal)
        response = client.post("/buffer/write", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422 and "finite" in response.json()["message"], response.text
    huge = {**base, "messages": [{"role": "user", "content": "x" * (65 * 1024 * 1024)}]}
    response = client.post("/buffer/write", json=huge)
    assert response.status_code == 413 and "exceeds the limit" in response.json()["message"]
    start_cases: list[tuple[dict, str]] = [
        ({"task_type": "nope", "input_file": str(input_file)}, "task_type"),
        ({"task_type": "external", "input_file": str(tmp_path / "missing.jsonl")}, "input_file"),
        ({"task_type": "external", "input_file": str(tmp_path)}, "input_file"),
        ({"task_type": "external", "input_file": str(input_file), "num_epoch": "many"}, "num_epoch"),
        ({"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "0"}, "num_repeat_per_sample"),
        ({"input_file": str(input_file)}, "task_type"),
    ]
    runs_before = client.get("/runs").json()["runs"]
    for body, field in start_cases:
        response = client.post("/start_rollout", json=body)
        assert 400 <= response.status_code < 500 and field in response.json()["message"], response.text
    assert client.get("/runs").json()["runs"] == runs_before, "a refused start stores no run"
    assert run_stats(client, run_id)["records"]["written"] == 0, "nothing was stored"
    assert client.get("/health").status_code == 200


def test_write_to_unknown_run_is_404(client: httpx.Client) -> None:
    response = client.post("/buffer/write", json=make_record("i0", run_id="no-such-run"))
    assert response.status_code == 404 and "no-such-run" in response.json()["message"]


def test_start_rollout_is_idempotent_and_accepts_string_values(client: httpx.Client, input_file: Path) -> None:
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "4",
            "num_epoch": "1", "num_process": "8", "max_tokens": "512",
            "sampling_params": {"max_tokens": 512, "temperature": 0.8, "top_p": 1.0}, "skip_instance_ids": []}
    first = client.post("/start_rollout", json=body).json()
    second = client.post("/start_rollout", json={**body, "num_process": "16"}).json()
    assert first["run_id"] == second["run_id"] and second["created"] is False
    assert "message" in first
    different = client.post("/start_rollout", json={**body, "num_repeat_per_sample": "2"}).json()
    assert different["run_id"] != first["run_id"]
    detail = run_stats(client, first["run_id"])
    assert detail["meta"]["group_size"] == "4"
    assert client.get("/runs").json()["active_run"] == different["run_id"]


def test_tasks_docs_and_metrics_are_served(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=2)
    assert client.post("/buffer/write", json=make_record("i0")).json()["data"]["run_id"] == run_id
    tasks = client.get("/tasks").json()
    assert {"external", "graded"} <= set(tasks["tasks"])
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/start_rollout", "/buffer/write", "/get_rollout_data", "/runs/{run_id}"} <= set(paths)
    metrics = client.get("/metrics").text
    assert f'rollout_buffer_records_written_total{{run_id="{run_id}",status="completed"}} 1.0' in metrics
    assert f'rollout_buffer_run{{run_id="{run_id}",stat="records_written"}} 1.0' in metrics


def _turns_record(instance_id: str, uid: str, run_id: str, logprob: float = -0.5) -> dict:
    record = make_record(instance_id, uid=uid, run_id=run_id)
    record["turns"] = [
        {"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [logprob, -1.25],
         "finish_reason": "stop", "weight_version": "3"},
        {"prompt_ids": [1, 2, 3, 4, 5, 9, 9], "output_ids": [6], "output_logprobs": [-0.1],
         "finish_reason": "stop", "weight_version": "3"},
    ]
    return record


def test_json_batch_write_is_all_or_nothing(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=2)
    records = [_turns_record(f"i{i // 2}", f"b{i}", run_id) for i in range(4)]
    bad = {**records[3], "reward": "lots"}
    refused = client.post("/buffer/write_batch", json={"run_id": run_id, "records": records[:3] + [bad]})
    assert refused.status_code == 422 and "records.3.reward" in refused.json()["message"]
    assert run_stats(client, run_id)["records"]["written"] == 0
    answer = client.post("/buffer/write_batch", json={"run_id": run_id, "records": records + records[:1]}).json()
    assert [r["outcome"] for r in answer["data"]["results"]] == ["stored", "completed", "stored", "completed",
                                                                 "duplicate"]
    data = read(client, run_id)["data"]["data"]
    assert sorted(r["uid"] for r in data) == ["b0", "b1", "b2", "b3"]
    assert next(r for r in data if r["uid"] == "b0")["turns"] == records[0]["turns"]


def _negative_id_batch(record: dict) -> bytes:
    """A packed batch whose last output id is -4: `pack_record` refuses to write one, a hand-made body can."""
    from rollout_buffer.wire.packed_batch import encode_batch
    from rollout_buffer.wire.packing import read_header

    body = encode_batch([record])
    header, start = read_header(body[4:])
    turn = header["_turns"][0]
    at = 4 + start + 4 * (turn["p"] + turn["o"] - 1)
    return body[:at] + (-4).to_bytes(4, "little", signed=True) + body[at + 4:]


def test_packed_batch_round_trips_exactly_and_refuses_bad_records(client: httpx.Client, input_file: Path) -> None:
    from rollout_buffer.wire.packed_batch import CONTENT_TYPE, encode_batch

    run_id = new_run(client, input_file, repeats=2)
    # a logprob that is not a float32 value is kept bit-exact (stored as float64)
    records = [_turns_record(f"i{i // 2}", f"p{i}", run_id, logprob=-0.1 * (i + 1)) for i in range(4)]
    headers = {"content-type": CONTENT_TYPE}
    bad_cases = [
        (encode_batch(records[:1]) + b"\x05\x00\x00\x00RB1", "record 1"),
        (encode_batch([{**records[0], "reward": float("nan")}]), "reward"),  # orjson writes NaN as null
        (_negative_id_batch(records[0]), "negative"),
        (encode_batch([{**records[0], "turns": [{**records[0]["turns"][0], "output_logprobs": [float("nan"), 0.0]}]}]),
         "finite"),
        (encode_batch([{k: v for k, v in records[0].items() if k != "instance_id"}]), "instance_id"),
        (b"", "empty batch"),
    ]
    for body, needle in bad_cases:
        response = client.post(f"/buffer/write_packed?run_id={run_id}", content=body, headers=headers)
        assert response.status_code == 422 and needle in response.json()["message"], response.text
    assert run_stats(client, run_id)["records"]["written"] == 0, "a refused batch stores nothing"
    answer = client.post(f"/buffer/write_packed?run_id={run_id}", content=encode_batch(records), headers=headers)
    assert answer.status_code == 200 and answer.json()["data"]["completed"] == 2, answer.text
    data = {r["uid"]: r for r in read(client, run_id)["data"]["data"]}
    for record in records:
        assert data[record["uid"]]["turns"] == record["turns"]
        assert data[record["uid"]]["messages"] == record["messages"] and data[record["uid"]]["run_id"] == run_id
