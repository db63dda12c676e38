"""`/metrics` and `/api/dashboard` over real HTTP: the same numbers from every API process on one Redis, per
run, gone with the run, no series growth, and the staleness helper's fields and read summaries rendered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")
# A task like the staleness helper's reads: each read's meta_info carries a staleness summary.
STALE_TASK = '''
TASK_TYPE = "stale"


def run_rollout(data):
    return None


def get_group_data_meta_info(temp_data):
    return {"staleness": {"min": 1, "mean": 1.5, "max": 2, "over_bound": 0}}
'''
Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str) -> dict[Sample, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def of_run(samples: dict[Sample, float], run_id: str) -> dict[Sample, float]:
    return {k: v for k, v in samples.items() if ("run_id", run_id) in k[1]}


def value(samples: dict[Sample, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(6)])


@pytest.fixture(scope="module")
def two_api_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two `serve` processes (no workers) sharing the first one's Redis; each test uses its own run ids."""
    tmp_path = tmp_path_factory.mktemp("two-apis")
    stale_dir = tmp_path / "stale_tasks"
    stale_dir.mkdir()
    (stale_dir / "stale_generator.py").write_text(STALE_TASK)
    args = ("--task-dir", TASKS, "--task-dir", str(stale_dir), "--workers", "0")
    with ServerProcess(tmp_path / "a", *args) as first:
        redis_url = f"unix://{(first.data_dir / 'redis.sock').resolve()}"
        with ServerProcess(tmp_path / "b", *args, "--redis-url", redis_url) as second:
            yield first, second


def test_every_api_process_renders_the_same_per_run_metrics(two_api_processes: tuple[ServerProcess, ServerProcess],
                                                            input_file: Path) -> None:
    first, second = two_api_processes
    with httpx.Client(base_url=first.url, timeout=30) as a, httpx.Client(base_url=second.url, timeout=30) as b:
        run_id = start_run(a, input_file, task_type="external", repeats=2, run_id="shared")
        other = start_run(a, input_file, task_type="external", repeats=2, run_id="other")
        for i in range(3):  # three complete groups written through the second process
            for k in range(2):
                record = make_record(f"i{i}", run_id=run_id, reward=float(k), timestamp=time.time())
                assert b.post("/buffer/write", json=record).status_code == 200
        b.post("/buffer/write", json=make_record("i5", run_id=run_id, status="failed", reward=0.0))
        assert b.post("/buffer/write", json=make_record("i0", uid="dup", run_id=other)).status_code == 200
        assert b.post("/buffer/write", json=make_record("i0", uid="dup", run_id=other)).status_code == 200
        batch = a.post("/get_rollout_data", json={"run_id": run_id, "num": 4, "lease_s": 60, "batch_id": "s1"}).json()
        assert len(batch["data"]["data"]) == 4
        assert a.post("/get_rollout_data", json={"run_id": run_id, "num": 4, "lease_s": 60,
                                                 "batch_id": "s1"}).json()["data"]["meta_info"]["retry"] is True
        assert b.post("/ack", json={"run_id": run_id, "batch_id": "s1"}).json()["success"]
        assert len(b.post("/get_rollout_data", json={"run_id": run_id}).json()["data"]["data"]) == 2
        from_a, from_b = scrape(first.url), scrape(second.url)
        for samples in (from_a, from_b):
            assert value(samples, "rollout_buffer_records_written_total", run_id=run_id, status="completed") == 6
            assert value(samples, "rollout_buffer_records_written_total", run_id=run_id, status="failed") == 1
            assert value(samples, "rollout_buffer_groups", run_id=run_id, state="handed") == 3
            assert value(samples, "rollout_buffer_groups", run_id=run_id, state="pending") == 1
            assert value(samples, "rollout_buffer_samples_handed_total", run_id=run_id) == 6
            assert value(samples, "rollout_buffer_reads_total", run_id=run_id) == 2, "the retry is the same read"
            assert value(samples, "rollout_buffer_batches_acked_total", run_id=run_id) == 1
            assert value(samples, "rollout_buffer_handover_delay_seconds_count", run_id=run_id) == 3
            assert 0 < value(samples, "rollout_buffer_handover_delay_seconds_sum", run_id=run_id) < 60
            assert value(samples, "rollout_buffer_duplicate_writes_total", run_id=other) == 1
        steady = {k: v for k, v in of_run(from_a, run_id).items() if not k[0].endswith("_per_second")}
        assert steady == {k: v for k, v in of_run(from_b, run_id).items() if not k[0].endswith("_per_second")}


def test_series_do_not_grow_and_go_away_with_their_run(tmp_path: Path, input_file: Path) -> None:
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS, "--workers", "0") as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        nothing = client.get("/api/dashboard").json()
        assert nothing["runs"] == [] and nothing["run"] is None and nothing["selected"] is None
        run_id = start_run(client, input_file, task_type="external", repeats=1, epochs=40, run_id="long")
        keep = start_run(client, input_file, task_type="external", repeats=1, run_id="keep")
        client.post("/buffer/write", json=make_record("i0", run_id=keep))

        def step(epoch: int) -> None:  # one training step of a long run: writes, a failure, a leased read
            for i in range(5):
                client.post("/buffer/write", json=make_record(f"i{i}", run_id=run_id, epoch=epoch, reward=i / 4))
            client.post("/buffer/write", json=make_record("i5", run_id=run_id, epoch=epoch, status="failed"))
            answer = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 60}).json()
            client.post("/ack", json={"run_id": run_id, "batch_id": answer["data"]["meta_info"]["batch_id"]})
        step(0)
        step(1)
        early = scrape(server.url)
        for epoch in range(2, 30):
            step(epoch)
        late = scrape(server.url)
        assert set(late) == set(early), "a long run adds values, not series"
        assert value(late, "rollout_buffer_samples_handed_total", run_id=run_id) == 30 * 6
        assert value(late, "rollout_buffer_reads_total", run_id=run_id) == 30
        assert client.delete(f"/runs/{run_id}").json()["success"]
        after = scrape(server.url)
        assert of_run(after, run_id) == {}, "a deleted run's series are gone"
        assert of_run(after, keep) == of_run(late, keep)
        db = redis.Redis(unix_socket_path=str(server.data_dir / "redis.sock"))
        assert not [k for k in db.keys("*") if b"{long}" in k], "and its read log and timeline keys with it"


def test_staleness_and_reads_reach_metrics_and_the_dashboard(two_api_processes: tuple[ServerProcess, ServerProcess],
                                                             input_file: Path) -> None:
    server, _ = two_api_processes
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_run(client, input_file, task_type="stale", repeats=2, run_id="stale-run")
        empty = client.get("/api/dashboard", params={"run_id": run_id}).json()["run"]["staleness"]
        assert empty["available"] is False and empty["values"] == [], "empty state before any staleness"
        for k in range(2):
            client.post("/buffer/write", json=make_record("i0", run_id=run_id, reward=float(k), raw_reward=float(k)))
        assert client.post("/get_rollout_data", json={"run_id": run_id}).json()["success"]
        # what the staleness helper's hand-over adds to the run's counters
        db = redis.Redis(unix_socket_path=str(server.data_dir / "redis.sock"))
        db.hset(f"rb:{{{run_id}}}:stats", mapping={"staleness_hist:1": 1, "staleness_hist:2": 1,
                                                   "stale_requeued_groups": 3, "stale_dropped_groups": 1})
        samples = scrape(server.url)
        assert value(samples, "rollout_buffer_staleness_versions_count", run_id=run_id) == 2
        assert value(samples, "rollout_buffer_staleness_versions_sum", run_id=run_id) == 3
        assert value(samples, "rollout_buffer_staleness_versions_bucket", run_id=run_id, le="1") == 1
        assert value(samples, "rollout_buffer_stale_groups_total", run_id=run_id, action="requeued") == 3
        assert value(samples, "rollout_buffer_reads_total", run_id=run_id) == 1
        assert value(samples, "rollout_buffer_handover_delay_seconds_count", run_id=run_id) == 1, \
            "records written without a timestamp are stamped when stored, so their group's delay is measured"
        detail = client.get("/api/dashboard", params={"run_id": run_id}).json()["run"]
        staleness = detail["staleness"]
        assert staleness["available"] and staleness["values"] == [1.0, 2.0] and staleness["counts"] == [1, 1]
        assert staleness["groups"] == {"requeued": 3, "dropped": 1}
        assert staleness["per_read"]["mean"] == [1.5] and staleness["per_read"]["max"] == [2]
        (read,) = detail["reads"]
        assert read["staleness"] == {"min": 1, "mean": 1.5, "max": 2, "over_bound": 0}
        assert read["reward"]["mean"] == 0.5 and read["groups"] == 1 and read["samples"] == 2
        assert detail["reward"]["last"]["hist"]["counts"] == [1] + [0] * 8 + [1]


def test_dashboard_api_names_unknown_runs_and_checks_its_parameters(two_api_processes: tuple[ServerProcess,
                                                                                            ServerProcess],
                                                                    input_file: Path) -> None:
    server, _ = two_api_processes
    with httpx.Client(base_url=server.url, timeout=30) as client:
        older = start_run(client, input_file, task_type="external", repeats=2, run_id="older")
        time.sleep(0.01)
        newer = start_run(client, input_file, task_type="external", repeats=2, run_id="newer")
        data = client.get("/api/dashboard").json()
        listed = [r["run_id"] for r in data["runs"]]
        assert listed[:2] == [newer, older], "newest first"
        assert data["selected"] == newer == data["active_run"] and data["run"]["run_id"] == newer
        assert data["runs"][0]["tasks"]["total"] == 0
        assert data["runs"][0]["epochs"] == [], "records come from outside: no task plan to measure epochs by"
        assert client.get("/api/dashboard", params={"run_id": older}).json()["run"]["run_id"] == older
        missing = client.get("/api/dashboard", params={"run_id": "nope"})
        assert missing.status_code == 404 and "nope" in missing.json()["message"]
        assert client.get("/api/dashboard", params={"reads": -1}).status_code == 422
        page = client.get("/")
        assert page.status_code == 200 and "static/dashboard/dashboard.js" in page.text
