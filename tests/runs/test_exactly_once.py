"""Exactly once, end to end, under faults: answers cut mid-body, a trainer that crashes and resumes from its
last checkpoint, the API process SIGKILLed during reads and batch writes, the embedded redis-server killed
under load. Each test ends with the same accounting: every group (or record) handed over exactly once."""

from __future__ import annotations

import copy
import os
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from slime_adapter.hooks.agent_rollout import generate_rollout, get_state, reset_state
from tests.support.faults import FaultProxy, LeasedReader, RetryingWriter, start_daemon
from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl
from tests.support.runtime_helpers import arithmetic_rows

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")


@pytest.fixture()
def adapter() -> Any:
    reset_state()
    yield
    reset_state()


def _trained(step: list[list[Any]]) -> list[tuple[int, str]]:
    """The (epoch, instance) of each group a trainer step returned."""
    keys = []
    for group in step:
        assert len({(s.metadata["epoch"], s.metadata["instance_id"]) for s in group}) == 1, "a group is one group"
        keys.append((group[0].metadata["epoch"], group[0].metadata["instance_id"]))
    return keys


@pytest.mark.parametrize("retention", [[], ["--retain-runs", "1"]], ids=["keep-runs", "retain-runs-1"])
def test_a_trainer_that_loses_answers_and_crashes_trains_every_group_once(
        tmp_path: Path, adapter: None, rollout_engine: Any, qwen_tokenizer_path: str, slime_data_buffer: Any,
        tiny_server: Any, retention: list[str]) -> None:
    """With `--retain-runs 1` the superseded first run is deleted as soon as the trainer resumes: the resumed
    trainer still reads its successor and trains every group once."""
    rows, epochs, group, batch = arithmetic_rows(8), 3, 2, 2
    steps = len(rows) * epochs // batch
    with ServerProcess(tmp_path / "data", *retention) as server:
        proxy = FaultProxy(server.url, cut_answers={2, 5, 9})
        engine = urlparse(rollout_engine.url)
        args = SimpleNamespace(
            rollout_buffer_url=tiny_server(proxy.app()), rollout_task_type="math",
            prompt_data=str(write_jsonl(tmp_path / "math.jsonl", rows)), n_samples_per_prompt=group,
            rollout_batch_size=batch, num_epoch=epochs, rollout_num_process=16, hf_checkpoint=qwen_tokenizer_path,
            loss_mask_type="qwen", rollout_max_response_len=128, rollout_temperature=1.0, rollout_top_p=1.0,
            sglang_router_ip=engine.hostname, sglang_router_port=engine.port, agent_fetch_timeout_s=10.0,
            fetch_trajectory_retry_times=20, agent_fetch_backoff_s=0.05, use_wandb=False, num_rollout=steps)
        buffer, lineage = slime_data_buffer(), []
        checkpoint: tuple[dict[str, Any], list[tuple[int, str]]] | None = None
        for step in range(5):
            lineage += _trained(generate_rollout(args, step, buffer))
            if step == 2:  # slime saves the data source's metadata with the checkpoint
                checkpoint = (copy.deepcopy(buffer.get_metadata()), list(lineage))
        first_run = get_state().run_id
        assert proxy.dropped == 2, "two answers were cut mid-body before the crash (and read again)"
        # The trainer crashes after step 4: steps 3-4 were trained but are lost with it.
        assert checkpoint is not None
        reset_state()
        metadata, lineage = checkpoint
        buffer = slime_data_buffer(metadata)
        for step in range(3, steps):
            lineage += _trained(generate_rollout(args, step, buffer))
        assert proxy.dropped == 3, "and one after the resume"
        assert proxy.content_types == {"application/x-rollout-buffer-packed"}, "the adapter reads the packed form"
        everything = {(e, r["instance_id"]) for e in range(epochs) for r in rows}
        assert Counter(lineage) == Counter(everything), "every (epoch, instance) group trained exactly once"
        with httpx.Client(base_url=server.url, timeout=30) as client:
            successor = get_state().run_id
            assert successor == f"{first_run}.r1"
            detail = client.get(f"/runs/{successor}").json()
            if retention:  # deleted; its tombstone names the successor
                old = client.get(f"/runs/{first_run}")
                assert old.status_code == 409 and old.json()["superseded_by"] == successor
                assert client.get("/runs").json()["runs"] == [successor]
            else:
                old = client.get(f"/runs/{first_run}").json()
                assert old["meta"]["status"] == "superseded", "groups of steps 3-4 were handed over and lost"
                retries = old["leases"]["batch_retries"] + detail["leases"]["batch_retries"]
                assert retries == 3, "each cut answer was read again as the same batch"
            assert detail["groups"]["leased"] == 0, "every batch was acknowledged"
            assert detail["groups"]["consumed"] == len(everything) - 6


def _kill_and_restart_at(server: ServerProcess, writer: RetryingWriter, fractions: list[float]) -> int:
    """SIGKILL the API process each time the writer has had these fractions of its records acknowledged
    (so each kill lands mid-stream), restarting it on the same port and data dir."""
    kills = 0
    for fraction in fractions:
        deadline = time.monotonic() + 60
        while len(writer.acknowledged) < fraction * len(writer.records):
            assert time.monotonic() < deadline, f"writes stalled: {writer.errors[-3:]}"
            time.sleep(0.005)
        server.kill(signal.SIGKILL)
        kills += 1
        server.start()
    return kills


def test_api_sigkilled_during_reads_and_batch_writes(tmp_path: Path) -> None:
    n = 240
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}"} for i in range(n)])
    server = ServerProcess(tmp_path / "data", "--task-dir", TASKS).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            run_id = start_run(client, input_file, task_type="external", repeats=2, run_id="killed-api")
        records = [make_record(f"i{i}", uid=f"u{i}-{k}", run_id=run_id) for i in range(n) for k in range(2)]
        writer = RetryingWriter(server.url, run_id, records, batch_size=4)
        reader = LeasedReader(server.url, run_id)
        threads = [start_daemon(writer.run), start_daemon(reader.run)]
        kills = _kill_and_restart_at(server, writer, [0.2, 0.45, 0.7])
        threads[0].join(timeout=120)
        reader.stop.set()
        threads[1].join(timeout=120)
        assert kills == 3 and not any(t.is_alive() for t in threads)
        assert writer.failures > 0 and reader.failures > 0, "kills landed during writes and during reads"
        assert len(writer.acknowledged) == len(records)
        uids = reader.uids()
        assert set(uids) == {r["uid"] for r in records} and set(uids.values()) == {1}, "each record once"
        with httpx.Client(base_url=server.url, timeout=30) as client:
            detail = client.get(f"/runs/{run_id}").json()
        assert detail["groups"]["consumed"] == n and detail["groups"]["leased"] == 0
        assert detail["records"]["written"] == 2 * n
    finally:
        server.stop()


def test_embedded_redis_killed_under_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    n = 300
    input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}"} for i in range(n)])
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            run_id = start_run(client, input_file, task_type="external", repeats=1, run_id="killed-redis")
            records = [make_record(f"i{i}", uid=f"r{i}", run_id=run_id) for i in range(n)]
            writer = RetryingWriter(server.url, run_id, records, batch_size=4)
            reader = LeasedReader(server.url, run_id)
            threads = [start_daemon(writer.run), start_daemon(reader.run)]
            deadline = time.monotonic() + 60
            while len(writer.acknowledged) < n // 3:
                assert time.monotonic() < deadline, f"writes stalled: {writer.errors[-3:]}"
                time.sleep(0.01)
            pid = int((server.data_dir / "redis.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            statuses = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    statuses.append(client.get("/health", timeout=2).status_code)
                except httpx.HTTPError:
                    statuses.append(0)
                if 503 in statuses and statuses[-1] == 200:
                    break
                time.sleep(0.01)
            assert 503 in statuses and statuses[-1] == 200, f"unhealthy while down, then healthy: {statuses[-20:]}"
            health = client.get("/health").json()
            assert health["redis_restarts"] == 1 and health["status"] == "ok"
            threads[0].join(timeout=120)
            reader.stop.set()
            threads[1].join(timeout=120)
            assert not any(t.is_alive() for t in threads)
            uids = reader.uids()
            assert set(writer.acknowledged) == {r["uid"] for r in records}
            assert set(uids) == set(writer.acknowledged) and set(uids.values()) == {1}, "nothing lost, nothing twice"
            detail = client.get(f"/runs/{run_id}").json()
            assert detail["records"]["written"] == n and detail["groups"]["consumed"] == n
