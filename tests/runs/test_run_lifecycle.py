"""Runs stop and go away: DELETE /runs/{id} returns Redis to its key count, superseded runs' workers stop,
retention deletes retired runs, group timeouts reach runs that are not the active one. On the embedded
Redis and on a real 3-node Redis Cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.backends import CLUSTER_BACKENDS, Backend, backend
from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl
from tests.support.process_tools import wait_for
from tests.support.runtime_helpers import arithmetic_rows, run_detail, start_native, write_rows

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")


@pytest.fixture(params=CLUSTER_BACKENDS)
def redis_backend(request: pytest.FixtureRequest) -> Backend:
    return backend(request)


def test_delete_run_mid_rollout_returns_redis_to_its_baseline(tmp_path: Path, rollout_engine: Any,
                                                               qwen_tokenizer_path: str,
                                                               redis_backend: Backend) -> None:
    rows = write_rows(tmp_path, arithmetic_rows(24))
    with ServerProcess(tmp_path / "data", "--workers", "2", *redis_backend.server_args()) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        rollout_engine.configure(latency_s=0.0)
        warm = start_native(client, rows, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                            repeats=1)
        wait_for(lambda: run_detail(client, warm)["meta"]["status"] == "finished", what="warm-up run finished")
        assert client.delete(f"/runs/{warm}").json()["success"]
        baseline = sorted(redis_backend.keys(server))
        assert not [k for k in baseline if b"{" in k], f"keys of the deleted run remain: {baseline}"
        rollout_engine.configure(latency_s=0.3)
        try:
            run_id = start_native(client, rows, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                                  repeats=2, epochs=3, num_process=4)
            wait_for(lambda: run_detail(client, run_id)["groups"]["completed"] >= 2, what="two groups")
            leased = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 600}).json()
            assert leased["success"]
            detail = run_detail(client, run_id)
            assert detail["tasks"]["running"] > 0 and detail["groups"]["leased"] >= 2, "deleted mid-rollout"
            assert client.delete(f"/runs/{run_id}").json()["success"]
            assert client.delete(f"/runs/{run_id}").status_code == 404
            # in-flight rollouts end (cancelled by their workers) and nothing re-creates the run's keys
            wait_for(lambda: rollout_engine.stats_dict()["in_flight"] == 0
                     and sorted(redis_backend.keys(server)) == baseline, 15.0,
                     "the deleted run's rollouts ended and its keys are gone")
            assert sorted(redis_backend.keys(server)) == baseline
            assert client.get(f"/runs/{run_id}").status_code == 404
            assert client.post("/get_rollout_data", json={"run_id": run_id}).status_code == 404
        finally:
            rollout_engine.configure(latency_s=0.0)


def test_a_superseded_runs_workers_stop(tmp_path: Path, rollout_engine: Any, qwen_tokenizer_path: str,
                                        redis_backend: Backend) -> None:
    rows = write_rows(tmp_path, arithmetic_rows(16))
    with ServerProcess(tmp_path / "data", *redis_backend.server_args()) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        rollout_engine.configure(latency_s=0.2)
        try:
            run_id = start_native(client, rows, engine_url=rollout_engine.url, tokenizer_path=qwen_tokenizer_path,
                                  repeats=1, epochs=4, num_process=4)
            wait_for(lambda: run_detail(client, run_id)["groups"]["ready"] >= 1, what="a ready group")
            handed = client.post("/get_rollout_data", json={"run_id": run_id, "num": 1}).json()
            assert handed["data"]["meta_info"]["finished_group_keys"]
            config = run_detail(client, run_id)["config"]
            restart = {k: config[k] for k in ("task_type", "input_file", "num_repeat_per_sample", "num_epoch",
                                               "remote_engine_url", "tokenizer_path", "sampling_params",
                                               "num_process", "run_id")}
            successor = client.post("/start_rollout", json={**restart, "skip_groups": []}).json()["run_id"]
            assert successor == f"{run_id}.r1", "the trainer without a checkpoint lost the handed-over group"
            wait_for(lambda: run_detail(client, run_id)["tasks"]["running"] == 0, 10.0,
                     "the superseded run's rollouts stopped")
            written = run_detail(client, run_id)["records"]["written"]
            # the successor's rollouts run on the same workers: once it has written more records, the
            # superseded run's workers had every chance to write too
            before = run_detail(client, successor)["records"]["written"]
            wait_for(lambda: run_detail(client, successor)["records"]["written"] >= before + 4,
                     what="the successor's rollouts go on")
            assert run_detail(client, run_id)["records"]["written"] == written, "nothing more is written to it"
            assert run_detail(client, run_id)["meta"]["status"] == "superseded"
        finally:
            rollout_engine.configure(latency_s=0.0)


def test_retention_deletes_retired_runs_only(tmp_path: Path, redis_backend: Backend) -> None:
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": "i0"}, {"instance_id": "i1"}])
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS, "--retain-runs", "2", "--run-ttl-s", "2",
                       *redis_backend.server_args()) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        drained = start_run(client, input_file, task_type="external", repeats=1, run_id="drained")
        for iid in ("i0", "i1"):
            client.post("/buffer/write", json=make_record(iid, run_id=drained))
        assert len(client.post("/get_rollout_data", json={"run_id": drained}).json()["data"]["data"]) == 2
        unread = start_run(client, input_file, task_type="external", repeats=1, run_id="unread")
        client.post("/buffer/write", json=make_record("i0", run_id=unread))  # a ready group nobody read yet
        newest = start_run(client, input_file, task_type="external", repeats=1, run_id="newest")
        client.post("/buffer/write", json=make_record("i0", run_id=newest))
        runs = client.get("/runs").json()["runs"]
        assert "drained" not in runs, "beyond the 2 newest and retired: deleted when the third run started"
        assert set(runs) == {"unread", "newest"}
        client.post("/get_rollout_data", json={"run_id": newest})
        # retention ran past the TTL (it deleted the run just drained) and kept the run with a ready group
        wait_for(lambda: client.get("/runs").json()["runs"] == ["unread"], 10.0,
                 "the drained run deleted after the TTL")
        client.post("/get_rollout_data", json={"run_id": unread})
        wait_for(lambda: client.get("/runs").json()["runs"] == [], 10.0, "drained runs deleted after the TTL")


RETENTION = {"retain-1": ["--retain-runs", "1"], "ttl": ["--run-ttl-s", "1"]}


@pytest.mark.parametrize(("policy", "redis_name"), [("retain-1", "embedded"), ("retain-1", "cluster"),
                                                    ("ttl", "embedded")])
def test_retention_keeps_the_chain_of_a_resumed_run(tmp_path: Path, policy: str, redis_name: str,
                                                    request: pytest.FixtureRequest) -> None:
    """A run hands groups over, a trainer that lost one resumes (`.r1`), retention deletes the superseded run,
    and the run is started again: it resumes `.r1`, no group is handed over twice, and the deleted id
    answers 409 naming its successor."""
    request.param = redis_name  # type: ignore[attr-defined]
    redis_backend = backend(request)
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"k{i}"} for i in range(3)])
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS, *RETENTION[policy],
                       *redis_backend.server_args()) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        handed: list[str] = []

        def take(run_id: str, iids: list[str]) -> None:
            for iid in iids:
                assert client.post("/buffer/write", json=make_record(iid, run_id=run_id)).json()["success"]
            meta = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 60}).json()["data"]["meta_info"]
            assert client.post("/ack", json={"run_id": run_id, "batch_id": meta["batch_id"]}).json()["success"], meta
            handed.extend(meta["finished_group_keys"])

        body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": "1",
                "num_epoch": "1", "run_id": "chain"}
        assert client.post("/start_rollout", json=body).json()["run_id"] == "chain"
        take("chain", ["k0", "k1"])
        resumed = client.post("/start_rollout", json={**body, "skip_groups": ["0:k0"]}).json()  # lost 0:k1
        assert resumed["run_id"] == "chain.r1" and resumed["created"]
        # an external task's run counts as finished at once: a ready group keeps .r1 from retiring meanwhile
        assert client.post("/buffer/write", json=make_record("k1", run_id="chain.r1")).json()["success"]
        wait_for(lambda: client.get("/runs").json()["runs"] == ["chain.r1"], 10.0, "retention deleted 'chain'")
        take("chain.r1", [])
        if policy == "ttl":  # .r1 retired too (nothing left to read): deleted, its handed and skip sets kept
            wait_for(lambda: client.get("/runs").json()["runs"] == [], 10.0, "retention deleted 'chain.r1'")
        for again in ({**body, "skip_groups": ["0:k0", "0:k1"]}, body):  # the trainer's truth; no skip fields
            answer = client.post("/start_rollout", json=again).json()
            assert answer["run_id"] == "chain.r1", "the chain leads to .r1"
        stored = [client.post("/buffer/write", json=make_record(iid, run_id="chain.r1")).json()["success"]
                  for iid in ("k0", "k1", "k2")]
        assert stored == [False, False, True], "writes for trained groups are refused"
        rest = client.post("/get_rollout_data", json={"run_id": "chain.r1"}).json()["data"]["meta_info"]
        handed.extend(rest["finished_group_keys"])
        assert sorted(handed) == ["0:k0", "0:k1", "0:k1", "0:k2"] and handed.count("0:k1") == 2
        assert handed[:2] == ["0:k0", "0:k1"] and handed[2:] == ["0:k1", "0:k2"], \
            "0:k1 twice only because the first trainer lost it; nothing .r1 handed over is handed again"
        for method, path, payload in (("POST", "/get_rollout_data", {"run_id": "chain"}),
                                      ("POST", "/ack", {"run_id": "chain", "batch_id": "b"}),
                                      ("POST", "/buffer/write", make_record("k2", run_id="chain")),
                                      ("GET", "/runs/chain", None)):
            gone = client.request(method, path, json=payload)
            assert gone.status_code == 409 and gone.json()["superseded_by"] == "chain.r1", (path, gone.text)
        assert client.delete("/runs/chain").status_code == 404, "a tombstone is not a run"


def test_group_timeouts_reach_runs_that_are_not_active(tmp_path: Path, redis_backend: Backend) -> None:
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": "i0"}])
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS, "--group-timeout-s", "0.3",
                       *redis_backend.server_args()) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        first = start_run(client, input_file, task_type="external", repeats=2, run_id="first")
        client.post("/buffer/write", json=make_record("i0", run_id=first))
        start_run(client, input_file, task_type="external", repeats=2, run_id="second")
        assert client.get("/runs").json()["active_run"] == "second"
        wait_for(lambda: run_detail(client, first)["drops"].get("group_timeout") == 1, 10.0,
                 "the inactive run's incomplete group timed out")
