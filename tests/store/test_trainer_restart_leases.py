"""A trainer restarted from its checkpoint while batches it read are still leased: what the checkpoint holds
is handed over (its ack died with the killed trainer), the rest goes back to the ready list. Handing a
trained group over again would train it twice; releasing it was what the buffer did before."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.store.test_handover import detail, exported, fill, read
from tests.support.backends import BACKENDS
from tests.support.helpers import ServerSpec, make_record, start_run, write_jsonl
from tests.support.process_tools import wait_for

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")
SERVER = ServerSpec(args=("--task-dir", TASKS), backends=BACKENDS)


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(4)])


def restart(client: httpx.Client, input_file: Path, run_id: str, epochs: int, **trained: list[str]) -> dict:
    """The `/start_rollout` a trainer restarted from its checkpoint sends (what it trained, by either field)."""
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1",
            "num_epoch": str(epochs), "run_id": run_id, **trained}
    answer = client.post("/start_rollout", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def new_run(client: httpx.Client, input_file: Path, epochs: int = 1) -> str:
    return start_run(client, input_file, task_type="external", repeats=1, epochs=epochs,
                     run_id=f"r-{uuid.uuid4().hex[:10]}")


def test_a_batch_the_checkpoint_holds_is_acknowledged_not_handed_over_again(client: httpx.Client,
                                                                            input_file: Path) -> None:
    run_id = new_run(client, input_file)
    fill(client, run_id, ["i0", "i1", "i2"], 1)
    trained = read(client, run_id, num=2, lease_s=600)["data"]["meta_info"]
    assert trained["finished_group_keys"] == ["0:i0", "0:i1"]
    # the trainer trained them and saved its checkpoint, then died before its next read carried the ack
    answer = restart(client, input_file, run_id, 1, skip_groups=["0:i0", "0:i1"])
    assert answer["run_id"] == run_id, "nothing handed over is missing from the checkpoint: no new generation"
    rest = read(client, run_id, lease_s=600)["data"]["meta_info"]
    assert rest["finished_group_keys"] == ["0:i2"], "the trained groups are not handed over a second time"
    run = detail(client, run_id)
    assert run["leases"]["restart_acked_batches"] == 1 and run["leases"]["lease_released"] == 0
    assert run["groups"]["consumed"] == 2 and exported(client, run_id, "restart_acked_batches") == 1
    late = client.post("/ack", json={"run_id": run_id, "batch_id": trained["batch_id"]}).json()
    assert late["data"]["results"][0]["outcome"] == "already_acked", "a late ack of that batch changes nothing"


def test_a_batch_the_checkpoint_holds_in_part_hands_over_that_part(client: httpx.Client, input_file: Path) -> None:
    """Over-sampling: the trainer took two groups of a three-group batch and held the third for its next
    step when it died; the checkpoint has the two."""
    run_id = new_run(client, input_file)
    fill(client, run_id, ["i0", "i1", "i2"], 1)
    read(client, run_id, num=3, lease_s=600)
    assert restart(client, input_file, run_id, 1, skip_groups=["0:i1", "0:i0"])["run_id"] == run_id
    again = read(client, run_id, lease_s=600)["data"]["meta_info"]
    assert again["finished_group_keys"] == ["0:i2"], "only the held group is read again"
    run = detail(client, run_id)
    assert run["leases"]["restart_handed_groups"] == 2 and run["leases"]["lease_released"] == 1
    assert run["groups"]["consumed"] == 2


def test_a_restart_that_trained_none_of_a_batch_gets_it_again(client: httpx.Client, input_file: Path) -> None:
    run_id = new_run(client, input_file)
    fill(client, run_id, ["i0", "i1"], 1)
    read(client, run_id, num=2, lease_s=600)
    assert restart(client, input_file, run_id, 1, skip_groups=[])["run_id"] == run_id
    assert read(client, run_id, lease_s=600)["data"]["meta_info"]["finished_group_keys"] == ["0:i0", "0:i1"]
    assert detail(client, run_id)["leases"]["restart_acked_batches"] == 0


def test_slimes_instance_id_list_counts_a_leased_trained_group_by_its_epoch(client: httpx.Client,
                                                                          input_file: Path) -> None:
    """slime's `skip_instance_ids` names an instance once per trained group. Epoch 0 of i0 was acknowledged,
    epoch 2 was trained but its ack lost, epoch 1 is still incomplete (its rollout is slow): [i0, i0] means
    epochs 0 and 2, not the first two epochs."""
    run_id = start_run(client, input_file, task_type="external", repeats=2, epochs=3,
                       run_id=f"r-{uuid.uuid4().hex[:10]}")
    fill(client, run_id, ["i0"], 2, epoch=0)
    first = read(client, run_id, lease_s=600)["data"]["meta_info"]
    assert client.post("/ack", json={"run_id": run_id, "batch_id": first["batch_id"]}).json()["success"]
    assert client.post("/buffer/write", json=make_record("i0", run_id=run_id, epoch=1)).json()["success"]
    fill(client, run_id, ["i0"], 2, epoch=2)
    assert read(client, run_id, lease_s=600)["data"]["meta_info"]["finished_group_keys"] == ["2:i0"]
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "2",
            "num_epoch": "3", "run_id": run_id, "skip_instance_ids": ["i0", "i0"]}
    assert client.post("/start_rollout", json=body).json()["run_id"] == run_id
    assert client.post("/buffer/write", json=make_record("i0", run_id=run_id, epoch=1)).json()["success"]
    rest = read(client, run_id, lease_s=600)["data"]["meta_info"]
    assert rest["finished_group_keys"] == ["1:i0"], "epoch 2 is not handed over again; epoch 1 is not skipped"
    assert detail(client, run_id)["leases"]["restart_acked_batches"] == 1


def test_a_trained_group_back_from_a_lease_that_ran_out_is_never_read_again(client: httpx.Client,
                                                                             input_file: Path) -> None:
    """Found by the chaos run (seed 7, 10 minutes): the trainer's lease ran out (renewals lost while the
    buffer restarted) after its checkpoint took the groups in, and it was killed before its next read could
    acknowledge them; the groups sat in the ready list, and the restarted trainer trained them twice (and,
    its step count fixed, never trained two others)."""
    run_id = new_run(client, input_file)
    fill(client, run_id, ["i0", "i1", "i2"], 1)
    lost = read(client, run_id, num=2, lease_s=1)["data"]["meta_info"]
    assert lost["finished_group_keys"] == ["0:i0", "0:i1"]
    # the lease runs out and the buffer's sweep (every second) puts its groups back in the ready list
    wait_for(lambda: detail(client, run_id)["leases"]["lease_expired"] == 1, 10, "the lease expired")
    assert restart(client, input_file, run_id, 1, skip_groups=["0:i0", "0:i1"])["run_id"] == run_id
    rest = read(client, run_id, lease_s=600)["data"]["meta_info"]
    assert rest["finished_group_keys"] == ["0:i2"], "the trained groups are handed over for good, unread"
    run = detail(client, run_id)
    assert run["leases"]["trained_passed_over"] == 2 and run["leases"]["lease_expired"] == 1
    assert run["groups"]["consumed"] == 2 and run["groups"]["ready"] == 0
    assert exported(client, run_id, "trained_passed_over") == 2
