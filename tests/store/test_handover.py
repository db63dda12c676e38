"""Exactly-once hand-over over real HTTP and a real Redis: leased reads, retries, acks, lease expiry, late
acks and renewals, uid idempotency for a run's life, epoch-exact resume keys, superseded runs. Every test
also runs on a server with `--retain-runs 1`, which deletes superseded runs at once (keeping a tombstone)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.support.backends import BACKENDS
from tests.support.helpers import ServerProcess, ServerSpec, make_record, start_run, write_jsonl
from tests.support.process_tools import wait_for

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")
RETAIN = "retain-runs-1"  # the embedded Redis, with retention deleting every run it may

SERVER = ServerSpec(args=("--task-dir", TASKS), backends=(*BACKENDS, RETAIN),
                    variants={RETAIN: ("--retain-runs", "1")})


@pytest.fixture()
def retains(server: ServerProcess) -> bool:
    """Whether the server deletes retired runs at once (`--retain-runs 1`)."""
    return "--retain-runs" in server.args


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(6)])


def new_run(client: httpx.Client, input_file: Path, **extra: object) -> str:
    extra.setdefault("run_id", f"h-{uuid.uuid4().hex[:10]}")
    return start_run(client, input_file, task_type="external", **extra)  # type: ignore[arg-type]


def fill(client: httpx.Client, run_id: str, instance_ids: list[str], repeats: int, epoch: int | None = None) -> None:
    for iid in instance_ids:
        for _ in range(repeats):
            extra = {} if epoch is None else {"epoch": epoch}
            assert client.post("/buffer/write", json=make_record(iid, run_id=run_id, **extra)).json()["success"]


def read(client: httpx.Client, run_id: str, **body: object) -> dict:
    response = client.post("/get_rollout_data", json={"run_id": run_id, **body})
    assert response.status_code == 200, response.text
    return response.json()


def detail(client: httpx.Client, run_id: str) -> dict:
    return client.get(f"/runs/{run_id}").json()


def exported(client: httpx.Client, run_id: str, name: str) -> float:
    """One run's counter as `GET /metrics` exports it (the same numbers as `/runs/{id}`)."""
    text = client.get("/metrics").text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == f"rollout_buffer_{name}_total" and s.labels.get("run_id") == run_id)


def test_a_leased_batch_stays_until_acked_and_a_retry_gets_the_same_batch(client: httpx.Client,
                                                                          input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=2)
    fill(client, run_id, ["i0", "i1", "i2"], 2)
    first = read(client, run_id, num=4, lease_s=60, batch_id="b-1")
    meta = first["data"]["meta_info"]
    assert meta["batch_id"] == "b-1" and meta["retry"] is False
    assert meta["finished_groups"] == ["i0", "i1"] and meta["finished_group_keys"] == ["0:i0", "0:i1"]
    groups = detail(client, run_id)["groups"]
    assert (groups["leased"], groups["ready"], groups["consumed"]) == (2, 1, 0), "leased, not handed over yet"
    retry = read(client, run_id, num=4, lease_s=60, batch_id="b-1")
    assert retry["data"]["data"] == first["data"]["data"], "a retry returns exactly the same records"
    assert retry["data"]["meta_info"]["retry"] is True
    assert retry["data"]["meta_info"]["total_samples"] == meta["total_samples"] == 6
    other = read(client, run_id, lease_s=60)
    assert other["data"]["meta_info"]["finished_groups"] == ["i2"], "a leased group is not handed to a new batch"
    second_id = other["data"]["meta_info"]["batch_id"]
    assert second_id and second_id != "b-1", "a leased read without batch_id gets a fresh one"
    acked = client.post("/ack", json={"run_id": run_id, "batch_ids": ["b-1", second_id]}).json()
    assert acked["success"] and [r["outcome"] for r in acked["data"]["results"]] == ["acked", "acked"]
    again = client.post("/ack", json={"run_id": run_id, "batch_id": "b-1"}).json()
    assert again["data"]["results"][0]["outcome"] == "already_acked"
    stale = read(client, run_id, lease_s=60, batch_id="b-1")
    assert not stale["success"] and "already acknowledged" in stale["message"]
    after = detail(client, run_id)
    assert (after["groups"]["leased"], after["groups"]["consumed"]) == (0, 3)
    assert after["leases"]["batches_acked"] == 2 and after["leases"]["batch_retries"] == 1


def test_an_ack_can_ride_on_the_next_read(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0"], 1)
    batch = read(client, run_id, lease_s=60)["data"]["meta_info"]["batch_id"]
    fill(client, run_id, ["i1"], 1)
    answer = read(client, run_id, lease_s=60, ack=[batch])
    assert answer["data"]["meta_info"]["acks"] == [{"batch_id": batch, "outcome": "acked", "groups": 1}]
    assert answer["data"]["meta_info"]["finished_groups"] == ["i1"]
    assert detail(client, run_id)["groups"]["consumed"] == 1


def test_an_expired_lease_puts_its_groups_back_at_the_head(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0", "i1"], 1)
    lost = read(client, run_id, num=1, lease_s=1)["data"]["meta_info"]["batch_id"]
    fill(client, run_id, ["i2"], 1)
    wait_for(lambda: detail(client, run_id)["leases"]["lease_expired"] == 1, 10.0,
             "the upkeep loop (every 1 s) ended the run-out lease")
    answer = read(client, run_id, lease_s=60)
    assert answer["data"]["meta_info"]["finished_groups"] == ["i0", "i1", "i2"], "expired group first, order kept"
    late = client.post("/ack", json={"run_id": run_id, "batch_id": lost}).json()
    assert not late["success"] and late["data"]["results"][0]["outcome"] == "expired"
    leases = detail(client, run_id)["leases"]
    assert leases["lease_expired"] == 1 and leases["late_acks"] == 1 and leases["late_acks_accepted"] == 0


def _expire(client: httpx.Client, run_id: str, count: int) -> None:
    """Wait until `count` leases of the run ran out (the upkeep loop ends them within about a second)."""
    wait_for(lambda: detail(client, run_id)["leases"]["lease_expired"] >= count, 10.0, f"{count} lease(s) expired")


def test_a_late_ack_is_accepted_when_nobody_read_the_groups_since(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0", "i1", "i2"], 1)
    slow = read(client, run_id, num=2, lease_s=1)["data"]["meta_info"]
    assert slow["finished_group_keys"] == ["0:i0", "0:i1"]
    _expire(client, run_id, 1)
    assert detail(client, run_id)["groups"]["ready"] == 3, "the expired groups went back to the ready list"
    late = client.post("/ack", json={"run_id": run_id, "batch_id": slow["batch_id"]}).json()
    assert late["success"] and late["data"]["results"] == [{"batch_id": slow["batch_id"], "outcome": "acked",
                                                            "groups": 2}]
    after = detail(client, run_id)
    assert (after["groups"]["ready"], after["groups"]["consumed"]) == (1, 2)
    assert after["leases"]["late_acks_accepted"] == 1 and after["leases"]["late_acks"] == 0
    assert (exported(client, run_id, "late_acks_accepted"), exported(client, run_id, "late_acks")) == (1, 0)
    rest = read(client, run_id, lease_s=60)["data"]["meta_info"]
    assert rest["finished_group_keys"] == ["0:i2"], "the late-acked groups are not handed over again"
    again = client.post("/ack", json={"run_id": run_id, "batch_id": slow["batch_id"]}).json()
    assert again["data"]["results"][0]["outcome"] == "already_acked"


def test_a_late_ack_is_refused_when_another_lease_took_the_groups(client: httpx.Client, input_file: Path) -> None:
    """A, then B (after A expired) read the same group; B's lease ran out too, so the group sits in the ready
    list again, untouched since B: B may still ack late, A may not (B may have trained it)."""
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0"], 1)
    first = read(client, run_id, lease_s=1)["data"]["meta_info"]["batch_id"]
    _expire(client, run_id, 1)
    second = read(client, run_id, lease_s=1)["data"]["meta_info"]
    assert second["finished_group_keys"] == ["0:i0"]
    _expire(client, run_id, 2)
    refused = client.post("/ack", json={"run_id": run_id, "batch_id": first}).json()
    assert not refused["success"] and refused["data"]["results"][0]["outcome"] == "expired"
    assert detail(client, run_id)["groups"]["ready"] == 1, "a refused late ack changes nothing"
    accepted = client.post("/ack", json={"run_id": run_id, "batch_id": second["batch_id"]}).json()
    assert accepted["data"]["results"][0]["outcome"] == "acked"
    leases = detail(client, run_id)["leases"]
    assert (leases["late_acks"], leases["late_acks_accepted"]) == (1, 1)
    assert not read(client, run_id, lease_s=60)["success"], "handed over once"


def test_a_renewed_lease_keeps_its_groups(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0", "i1"], 1)
    held = read(client, run_id, num=1, lease_s=1.5)["data"]["meta_info"]["batch_id"]
    deadline = time.monotonic() + 3.5  # more than two lease lengths, renewed every 0.3 s
    while time.monotonic() < deadline:
        renewed = client.post("/ack", json={"run_id": run_id, "batch_id": held, "renew": True}).json()
        assert renewed["success"] and renewed["data"]["results"][0]["outcome"] == "renewed", renewed
        time.sleep(0.3)  # the renewal period itself: nothing to wait on
    other = read(client, run_id, lease_s=60)["data"]["meta_info"]
    assert other["finished_group_keys"] == ["0:i1"], "the renewed batch's group was not handed to another read"
    assert client.post("/ack", json={"run_id": run_id, "batch_id": held}).json()["success"]
    done = client.post("/ack", json={"run_id": run_id, "batch_id": held, "renew": True}).json()
    assert not done["success"] and done["data"]["results"][0]["outcome"] == "already_acked"
    unknown = client.post("/ack", json={"run_id": run_id, "batch_id": "never-read", "renew": True}).json()
    assert unknown["data"]["results"][0]["outcome"] == "unknown"
    leases = detail(client, run_id)["leases"]
    assert leases["lease_expired"] == 0 and leases["lease_renewals"] >= 5
    assert exported(client, run_id, "lease_renewals") == leases["lease_renewals"]


def test_an_expired_lease_nobody_took_can_be_renewed(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0"], 1)
    held = read(client, run_id, lease_s=1)["data"]["meta_info"]["batch_id"]
    _expire(client, run_id, 1)
    renewed = client.post("/ack", json={"run_id": run_id, "batch_id": held, "renew": True}).json()
    assert renewed["data"]["results"][0]["outcome"] == "renewed"
    assert detail(client, run_id)["groups"]["leased"] == 1 and detail(client, run_id)["groups"]["ready"] == 0
    assert not read(client, run_id, lease_s=60)["success"], "leased again: no other read gets it"
    assert detail(client, run_id)["leases"]["leases_reclaimed"] == 1
    assert exported(client, run_id, "leases_reclaimed") == 1


def test_a_read_without_lease_keeps_slime_semantics(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0"], 1)
    answer = read(client, run_id)
    assert "batch_id" not in answer["data"]["meta_info"]
    assert detail(client, run_id)["groups"]["consumed"] == 1, "handed over at once, as slime's buffer does"
    bad = client.post("/get_rollout_data", json={"run_id": run_id, "batch_id": "x"})
    assert bad.status_code == 422 and "lease_s" in bad.json()["message"]


def test_a_uid_is_a_duplicate_for_the_runs_life(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1, epochs=3)
    record = make_record("i0", uid="legacy-retry", run_id=run_id)
    assert client.post("/buffer/write", json=record).json()["data"]["group_completed"]
    assert read(client, run_id)["data"]["meta_info"]["finished_group_keys"] == ["0:i0"]
    for _ in range(2):  # a legacy writer retrying after a timeout, after the read: not a new epoch-1 record
        answer = client.post("/buffer/write", json=record).json()
        assert answer["success"] and answer["data"]["outcome"] == "duplicate"
    records = detail(client, run_id)["records"]
    assert (records["written"], records["duplicates"]) == (1, 2)
    assert not read(client, run_id)["success"]


def test_resume_keys_are_epoch_exact(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1, epochs=3)
    fill(client, run_id, ["i0", "i1"], 1, epoch=0)
    fill(client, run_id, ["i0"], 1, epoch=1)
    keys = read(client, run_id)["data"]["meta_info"]["finished_group_keys"]
    assert keys == ["0:i0", "0:i1", "1:i0"]
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1",
            "num_epoch": "3", "run_id": run_id}
    same = client.post("/start_rollout", json={**body, "skip_groups": keys}).json()
    assert same["run_id"] == run_id and same["skipped_groups"] == 3, "the checkpoint has every handed-over group"
    for epoch, iid, stored in ((0, "i0", False), (1, "i0", False), (2, "i0", True), (1, "i1", True)):
        answer = client.post("/buffer/write", json=make_record(iid, run_id=run_id, epoch=epoch)).json()
        assert answer["success"] is stored, (epoch, iid, answer)
    assert detail(client, run_id)["drops"]["skipped_group"] == 2


def test_slime_instance_ids_count_trained_groups(client: httpx.Client, input_file: Path) -> None:
    """slime's stock client sends one instance id per trained group (its metadata lists, concatenated)."""
    run_id = new_run(client, input_file, repeats=1, epochs=3, skip_instance_ids=["i0", "i0", "i1"])
    outcomes = {(e, iid): client.post("/buffer/write", json=make_record(iid, run_id=run_id, epoch=e)).json()["success"]
                for e in range(3) for iid in ("i0", "i1")}
    assert outcomes == {(0, "i0"): False, (1, "i0"): False, (2, "i0"): True,
                        (0, "i1"): False, (1, "i1"): True, (2, "i1"): True}


def test_a_checkpoint_missing_handed_groups_supersedes_the_run(client: httpx.Client, input_file: Path,
                                                               retains: bool) -> None:
    run_id = new_run(client, input_file, repeats=1, epochs=2)
    fill(client, run_id, ["i0", "i1"], 1, epoch=0)
    assert read(client, run_id)["data"]["meta_info"]["finished_group_keys"] == ["0:i0", "0:i1"]
    fill(client, run_id, ["i2"], 1, epoch=0)  # ready, never handed over
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1",
            "num_epoch": "2", "run_id": run_id, "skip_groups": ["0:i0"]}  # the trainer lost 0:i1
    answer = client.post("/start_rollout", json=body).json()
    successor = answer["run_id"]
    assert successor == f"{run_id}.r1" and answer["created"] is True and answer["skipped_groups"] == 1
    late = client.post("/buffer/write", json=make_record("i3", run_id=run_id))
    assert late.status_code == 409 and late.json()["superseded_by"] == successor
    stale_read = client.post("/get_rollout_data", json={"run_id": run_id})
    assert stale_read.status_code == 409 and stale_read.json()["superseded_by"] == successor
    if retains:  # deleted at once; its tombstone still names the successor
        gone = client.get(f"/runs/{run_id}")
        assert gone.status_code == 409 and gone.json()["superseded_by"] == successor
        assert run_id not in client.get("/runs").json()["runs"]
    else:
        assert detail(client, run_id)["drops"]["run_superseded"] == 1
        assert client.delete(f"/runs/{run_id}").status_code == 200
        gone = client.post("/get_rollout_data", json={"run_id": run_id})
        assert gone.status_code == 409 and gone.json()["superseded_by"] == successor, "DELETE keeps the link"
    for epoch, iid, stored in ((0, "i0", False), (0, "i1", True), (0, "i2", True), (1, "i0", True)):
        assert client.post("/buffer/write", json=make_record(iid, epoch=epoch)).json()["success"] is stored, (epoch, iid)
    assert client.get("/runs").json()["active_run"] == successor


def test_a_new_trainer_session_releases_the_old_sessions_leases(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    fill(client, run_id, ["i0"], 1)
    read(client, run_id, lease_s=600)
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1",
            "num_epoch": "1", "run_id": run_id, "skip_groups": []}
    assert client.post("/start_rollout", json=body).json()["run_id"] == run_id
    answer = read(client, run_id, lease_s=600)
    assert answer["data"]["meta_info"]["finished_groups"] == ["i0"], "no 10-minute wait for a dead trainer's lease"
    assert detail(client, run_id)["leases"]["lease_released"] == 1


def test_bad_ack_and_resume_keys_are_422(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file, repeats=1)
    assert client.post("/ack", json={"run_id": run_id}).status_code == 422
    assert client.post("/ack", json={"run_id": run_id, "batch_id": "no spaces"}).status_code == 422
    body = {"task_type": "external", "input_file": str(input_file), "skip_groups": ["i0"]}
    response = client.post("/start_rollout", json=body)
    assert response.status_code == 422 and "skip_groups[0]" in response.json()["message"]
    unknown = client.post("/ack", json={"run_id": run_id, "batch_id": "never-read"}).json()
    assert not unknown["success"] and unknown["data"]["results"][0]["outcome"] == "unknown"
