"""The packed binary read (`Accept: application/x-rollout-buffer-packed`) against the JSON answer, over real
HTTP and a real Redis: the same read in both forms carries the same records, bit for bit; hook changes show
in the packed headers; leases, retries and acks behave the same; negotiation falls back to JSON; a broken
body is refused by `decode` with a message that says where."""

from __future__ import annotations

import math
import struct
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_buffer.wire import packed_read
from rollout_buffer.wire.packed_batch import CONTENT_TYPE as WRITE_PACKED
from rollout_buffer.wire.packed_batch import encode_batch
from rollout_buffer.wire.packed_read import PackedReadError, decode, encode_answer, stored_record, wants_packed
from rollout_buffer.wire.packing import pack_record, read_header, unpack_record
from tests.support.helpers import ServerSpec, start_run, write_jsonl
from tests.support.trajectories import bits, forked_trajectory, plain, tool_trajectory

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")
PACKED = {"accept": packed_read.accept_header(True)}

# A module whose group hook changes turns three ways: a new list of new turns, arrays replaced in place, a
# turn's finish_reason changed in place. Each such record must be packed anew, not re-stamped.
TRIM_TASK = '''
TASK_TYPE = "trim"


def run_rollout(data):
    return None


def _trim(turn):
    turn["output_ids"] = turn["output_ids"][:2]
    turn["output_logprobs"] = None if turn["output_logprobs"] is None else turn["output_logprobs"][:2]


def transform_group(group, task_type):
    instance_id, items = group
    first, second, third = items
    turns = [dict(t) for t in first["turns"]]
    _trim(turns[-1])
    _trim(second["turns"][-1])
    third["turns"][0]["finish_reason"] = "edited"
    try:
        third["turns"][1]["output_ids"][0] = 7
    except ValueError:
        third["extra_info"]["in_place_write"] = "refused"
    return instance_id, [{**first, "turns": turns, "reward": first["reward"] + 10}, second, third]
'''


SERVER = ServerSpec(args=("--task-dir", TASKS, "--workers", "0"), task_files={"trim_generator.py": TRIM_TASK})


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(4)])


def new_run(client: httpx.Client, input_file: Path, task_type: str = "external", repeats: int = 2) -> str:
    return start_run(client, input_file, task_type=task_type, repeats=repeats, run_id=f"p-{uuid.uuid4().hex[:10]}")


def write(client: httpx.Client, run_id: str, records: list[dict[str, Any]]) -> None:
    for record in records:
        answer = client.post("/buffer/write", json={**record, "run_id": run_id})
        assert answer.status_code == 200 and answer.json()["success"], answer.text


def read_json(client: httpx.Client, run_id: str, **body: Any) -> dict[str, Any]:
    response = client.post("/get_rollout_data", json={"run_id": run_id, **body}, headers={"accept": "application/json"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json", response.text
    return response.json()


def read_packed(client: httpx.Client, run_id: str, **body: Any) -> tuple[dict[str, Any], bytes]:
    response = client.post("/get_rollout_data", json={"run_id": run_id, **body}, headers=PACKED)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == packed_read.CONTENT_TYPE
    assert "accept" in response.headers["vary"].lower()
    return decode(response.content), response.content


def raw_records(body: bytes) -> list[bytes]:
    """The packed records of an answer body, undecoded."""
    (head,) = struct.unpack_from("<I", body, 0)
    offset, found = 4 + head, []
    while offset < len(body):
        (length,) = struct.unpack_from("<I", body, offset)
        found.append(body[offset + 4:offset + 4 + length])
        offset += 4 + length
    return found


def without_retry(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "retry"}


def test_one_read_in_both_forms_carries_identical_records(client: httpx.Client, input_file: Path,
                                                         qwen_tokenizer: Any) -> None:
    run_id = new_run(client, input_file)
    records = [tool_trajectory(qwen_tokenizer, "i0", 1, exact32=False),
               tool_trajectory(qwen_tokenizer, "i0", 2, exact32=True),
               forked_trajectory(qwen_tokenizer, "i1", 3),
               {"uid": "i1-plain", "instance_id": "i1", "reward": 0.25, "extra_info": {}, "status": "failed",
                "timestamp": 2000.0, "messages": [{"role": "user", "content": "hi"}]}]
    write(client, run_id, records)
    as_json = read_json(client, run_id, lease_s=60, batch_id="both")
    packed, body = read_packed(client, run_id, lease_s=60, batch_id="both")  # a retry: the same batch
    assert packed["success"] is as_json["success"] is True and packed["message"] == as_json["message"]
    assert packed["data"]["meta_info"]["retry"] is True and as_json["data"]["meta_info"]["retry"] is False
    assert without_retry(packed["data"]["meta_info"]) == without_retry(as_json["data"]["meta_info"])
    got = packed["data"]["data"]
    assert [r["uid"] for r in got] == [r["uid"] for r in as_json["data"]["data"]] == [r["uid"] for r in records]
    assert plain(got) == as_json["data"]["data"], "same records, same numbers"
    for record, written in zip(got, records):
        assert "turns" not in record if "turns" not in written else len(record["turns"]) == len(written["turns"])
        for turn, sent in zip(record.get("turns") or [], written.get("turns") or []):
            assert turn["prompt_ids"].dtype == turn["output_ids"].dtype == np.int32
            assert not turn["output_ids"].flags.writeable
            assert turn["prompt_ids"].tolist() == sent["prompt_ids"]
            assert turn["output_ids"].tolist() == sent["output_ids"]
            if sent["output_logprobs"] is None:
                assert turn["output_logprobs"] is None
            else:
                assert turn["output_logprobs"].dtype == np.float64
                assert bits(turn["output_logprobs"]) == bits(sent["output_logprobs"]), "bit-identical logprobs"
            assert turn.get("version_spans") == sent.get("version_spans")
            assert (turn["finish_reason"], turn["weight_version"]) == (sent["finish_reason"], sent["weight_version"])
    for turn, sent in zip(as_json["data"]["data"][0]["turns"], records[0]["turns"]):
        assert bits(turn["output_logprobs"]) == bits(sent["output_logprobs"]), "the JSON answer prints float64 exactly"
    stored = [read_header(blob)[0] for blob in raw_records(body)]
    assert [h["_turns"][0]["lp"] for h in stored[:3]] == [8, 4, 0], "float64 kept where float32 cannot hold it"
    assert stored[0]["_turns"][1]["ext"] is True and stored[2]["_turns"][1]["ext"] is False


def test_hooks_that_change_rewards_show_in_the_packed_headers(client: httpx.Client, input_file: Path,
                                                             qwen_tokenizer: Any) -> None:
    run_id = new_run(client, input_file, task_type="graded")
    zero = [tool_trajectory(qwen_tokenizer, "i0", s, exact32=True) for s in (1, 2)]
    for record in zero:
        record["reward"] = 0.0  # an all-zero group: the task's is_valid_group filters it
    graded = [tool_trajectory(qwen_tokenizer, "i1", s, exact32=True) for s in (3, 4)]
    graded[0]["reward"], graded[1]["reward"] = 1.0, 3.0
    write(client, run_id, zero + graded)
    packed, body = read_packed(client, run_id, lease_s=60, batch_id="g")
    as_json = read_json(client, run_id, lease_s=60, batch_id="g")
    assert plain(packed["data"]["data"]) == as_json["data"]["data"]
    assert packed["data"]["meta_info"]["filtered_groups"] == ["i0"]
    assert packed["data"]["meta_info"]["hook_groups"] == ["i0", "i1"], "get_group_data_meta_info reaches the envelope"
    headers = [read_header(blob)[0] for blob in raw_records(body)]
    assert [h["uid"] for h in headers] == [r["uid"] for r in graded]
    assert [h["reward"] for h in headers] == pytest.approx([-1.0, 1.0], abs=1e-5), "normalised in the header"
    assert [h["raw_reward"] for h in headers] == [1.0, 3.0] and {h["epoch"] for h in headers} == {0}
    assert unpack_record(raw_records(body)[0])["turns"] == plain(packed["data"]["data"][0]["turns"])


def test_a_hook_that_changes_turns_gets_them_packed_anew(client: httpx.Client, input_file: Path,
                                                        qwen_tokenizer: Any) -> None:
    run_id = new_run(client, input_file, task_type="trim", repeats=3)
    records = [tool_trajectory(qwen_tokenizer, "i0", s, exact32=s == 1) for s in (1, 2, 3)]
    write(client, run_id, records)
    packed, _ = read_packed(client, run_id, lease_s=60, batch_id="t")
    as_json = read_json(client, run_id, lease_s=60, batch_id="t")
    assert plain(packed["data"]["data"]) == as_json["data"]["data"]
    new_list, in_place, scalar = packed["data"]["data"]
    for record, written in zip((new_list, in_place), records):
        last = record["turns"][-1]
        assert last["output_ids"].tolist() == written["turns"][-1]["output_ids"][:2]
        assert bits(last["output_logprobs"]) == bits(written["turns"][-1]["output_logprobs"][:2])
        assert record["turns"][0]["output_ids"].tolist() == written["turns"][0]["output_ids"], "untouched turn"
    assert new_list["reward"] == records[0]["reward"] + 10
    assert [t["finish_reason"] for t in scalar["turns"]] == ["edited", "stop"]
    assert scalar["extra_info"]["in_place_write"] == "refused", "hooks see read-only arrays"
    assert scalar["turns"][1]["output_ids"].tolist() == records[2]["turns"][1]["output_ids"]


def test_leases_retries_and_acks_work_the_same_in_packed_form(client: httpx.Client, input_file: Path,
                                                             qwen_tokenizer: Any) -> None:
    run_id = new_run(client, input_file, repeats=1)
    write(client, run_id, [tool_trajectory(qwen_tokenizer, f"i{i}", i, exact32=True) for i in range(3)])
    first, body = read_packed(client, run_id, num=2, lease_s=60, batch_id="b-1")
    meta = first["data"]["meta_info"]
    assert meta["batch_id"] == "b-1" and meta["finished_group_keys"] == ["0:i0", "0:i1"] and meta["retry"] is False
    lost, again = read_packed(client, run_id, num=2, lease_s=60, batch_id="b-1")  # the first answer was lost
    assert lost["data"]["meta_info"]["retry"] is True
    assert plain(lost["data"]["data"]) == plain(first["data"]["data"]) and raw_records(again) == raw_records(body)
    nxt, _ = read_packed(client, run_id, lease_s=60, batch_id="b-2", ack=["b-1"])
    assert nxt["data"]["meta_info"]["acks"] == [{"batch_id": "b-1", "outcome": "acked", "groups": 2}]
    assert nxt["data"]["meta_info"]["finished_groups"] == ["i2"]
    done, _ = read_packed(client, run_id, lease_s=60, batch_id="b-1")
    assert done["success"] is False and "already acknowledged" in done["message"] and done["data"]["data"] == []
    empty, _ = read_packed(client, run_id)
    assert empty["success"] is False and empty["message"] == "no group is ready"
    groups = client.get(f"/runs/{run_id}").json()["groups"]
    assert (groups["leased"], groups["consumed"]) == (1, 2)


def test_errors_stay_json_and_other_accept_headers_get_json(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    write(client, run_id, [{"uid": f"u{i}", "instance_id": f"i{i}", "reward": 1.0, "extra_info": {},
                            "messages": [{"role": "user", "content": "q"}]} for i in range(2)])
    for accept in ("*/*", "text/html", f"{packed_read.CONTENT_TYPE};q=0", f"{packed_read.CONTENT_TYPE};q=0.2, */*",
                   ""):
        response = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 60, "batch_id": "j"},
                               headers={"accept": accept})
        assert response.status_code == 200 and response.headers["content-type"] == "application/json", accept
        assert response.json()["data"]["data"][0]["uid"] == "u0"
    bad = client.post("/get_rollout_data", json={"run_id": run_id, "num": 0}, headers=PACKED)
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/json"
    assert "num" in bad.json()["message"]
    unknown = client.post("/get_rollout_data", json={"run_id": "no-such-run"}, headers=PACKED)
    assert unknown.status_code == 404 and "no-such-run" in unknown.json()["message"]
    assert client.post("/ack", json={"run_id": run_id, "batch_id": "j"}).json()["success"]
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1", "run_id": run_id,
            "skip_groups": ["0:i0"]}  # the trainer lost i1, which was handed over: the run is superseded
    successor = client.post("/start_rollout", json=body).json()["run_id"]
    stale = client.post("/get_rollout_data", json={"run_id": run_id}, headers=PACKED)
    assert stale.status_code == 409 and stale.json()["superseded_by"] == successor
    documented = client.get("/openapi.json").json()["paths"]["/get_rollout_data"]["post"]["responses"]["200"]
    assert set(documented["content"]) == {"application/json", packed_read.CONTENT_TYPE}


def test_negotiation_rule() -> None:
    assert wants_packed(packed_read.accept_header(True))
    assert wants_packed(packed_read.CONTENT_TYPE) and wants_packed(f"application/json, {packed_read.CONTENT_TYPE}")
    assert wants_packed(f"{packed_read.CONTENT_TYPE.upper()}; q=0.9, application/json; q=0.8")
    for accept in (None, "", "application/json", "*/*", packed_read.accept_header(False),
                   f"{packed_read.CONTENT_TYPE};q=0", f"{packed_read.CONTENT_TYPE};q=0.5, application/*",
                   f"{packed_read.CONTENT_TYPE};q=oops"):
        assert not wants_packed(accept), accept


def _answer(records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], list[bytes]]:
    """A JSON-shaped answer over stored blobs of `records` (as the server builds it), and the blobs."""
    blobs = [pack_record(r) for r in records]
    handed, stored = [], {}
    for blob in blobs:
        record, source = stored_record(blob)
        handed.append(record)
        stored[record["uid"]] = source
    return {"success": True, "message": "m", "data": {"data": handed, "meta_info": {"n": 1}}}, stored, blobs


def test_decode_refuses_broken_bodies_saying_where(qwen_tokenizer: Any) -> None:
    records = [tool_trajectory(qwen_tokenizer, "i0", s, exact32=True) for s in (1, 2)]
    answer, stored, _ = _answer(records)
    body = encode_answer(answer, stored)
    assert plain(decode(body)["data"]["data"]) == [unpack_record(pack_record(r)) for r in records]
    with pytest.raises(PackedReadError, match="envelope: truncated length prefix"):
        decode(body[:3])
    with pytest.raises(PackedReadError, match=r"record 1 of 2: \d+ bytes announced .* \(truncated body\)"):
        decode(body[:-10])
    with pytest.raises(PackedReadError, match="bytes after the last of 2 records"):
        decode(body + b"\0")
    with pytest.raises(PackedReadError, match="envelope is not JSON"):
        decode(struct.pack("<I", 4) + b"nope")
    with pytest.raises(PackedReadError, match="data.count"):
        decode(struct.pack("<I", 2) + b"{}")
    (head,) = struct.unpack_from("<I", body, 0)
    broken = bytearray(body)
    broken[4 + head + 4:4 + head + 7] = b"XXX"  # the first record's magic
    with pytest.raises(PackedReadError, match="record 0 of 2: not a packed rollout record"):
        decode(bytes(broken))


@settings(max_examples=60, deadline=None)
@given(cut=st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_every_truncation_is_refused(cut: float) -> None:
    record = {"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0, "extra_info": {},
              "turns": [{"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.1, -math.inf]},
                        {"prompt_ids": [1, 2, 3, 4, 5, 6], "output_ids": [7], "output_logprobs": [-0.5]}]}
    answer, stored, _ = _answer([record, {**record, "uid": "v"}])
    body = encode_answer(answer, stored)
    with pytest.raises(PackedReadError):
        decode(body[:int(cut * len(body))])


turn_strategy = st.fixed_dictionaries({
    "prompt_ids": st.lists(st.integers(0, 2**31 - 1), max_size=12),
    "output_ids": st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12),
    "extends": st.booleans(),
    "logprobs": st.sampled_from(["none", "f32", "f64"]),
    "finish_reason": st.sampled_from(["stop", "length", None]),
})


@settings(max_examples=80, deadline=None)
@given(turns=st.lists(st.lists(turn_strategy, min_size=1, max_size=4), min_size=1, max_size=4),
       rewards=st.lists(st.floats(-5, 5), min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_packed_answers_round_trip_with_header_changes(turns: list[list[dict[str, Any]]], rewards: list[float],
                                                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    records = []
    for n, drawn in enumerate(turns):
        history: list[int] = []
        built = []
        for turn in drawn:
            prompt = history + turn["prompt_ids"] if turn["extends"] and built else turn["prompt_ids"]
            out = turn["output_ids"]
            values = -5 * rng.random(len(out))
            logprobs = {"none": None, "f32": values.astype(np.float32).astype(float).tolist(),
                        "f64": values.tolist()}[turn["logprobs"]]
            built.append({"prompt_ids": prompt, "output_ids": out, "output_logprobs": logprobs,
                          "finish_reason": turn["finish_reason"], "weight_version": n})
            history = prompt + out
        records.append({"uid": f"u{n}", "instance_id": "i", "messages": [{"role": "user", "content": "x"}],
                        "reward": 0.0, "extra_info": {"n": n}, "turns": built})
    answer, stored, _ = _answer(records)
    for record, reward in zip(answer["data"]["data"], rewards):  # what a hook may do to header fields
        record["reward"], record["raw_reward"], record["epoch"] = reward, 0.0, 2
    expected = plain(answer["data"]["data"])
    back = decode(encode_answer(answer, stored))
    assert plain(back["data"]["data"]) == expected
    assert back["data"]["meta_info"] == {"n": 1} and back["success"] is True and back["message"] == "m"
    assert [r["reward"] for r in back["data"]["data"]] == rewards[:len(records)]


def test_write_packed_then_read_packed_keeps_minus_infinity(client: httpx.Client, input_file: Path) -> None:
    """JSON has no -inf (it prints null, as before); the packed read keeps the value itself."""
    run_id = new_run(client, input_file, repeats=1)
    record = {"uid": "inf", "instance_id": "i0", "reward": 1.0, "extra_info": {}, "run_id": run_id,
              "messages": [{"role": "user", "content": "q"}],
              "turns": [{"prompt_ids": [1, 2], "output_ids": [3, 4], "output_logprobs": [-math.inf, -0.25]}]}
    stored = client.post(f"/buffer/write_packed?run_id={run_id}", content=encode_batch([record]),
                         headers={"content-type": WRITE_PACKED})
    assert stored.status_code == 200 and stored.json()["success"], stored.text
    packed, _ = read_packed(client, run_id, lease_s=60, batch_id="inf")
    assert packed["data"]["data"][0]["turns"][0]["output_logprobs"].tolist() == [-math.inf, -0.25]
    as_json = read_json(client, run_id, lease_s=60, batch_id="inf")
    assert as_json["data"]["data"][0]["turns"][0]["output_logprobs"] == [None, -0.25]
