"""A Redis Cluster primary killed under acknowledged writes and leased reads: what the buffer loses.

A real cluster of 3 primaries + 3 replicas (`tests/support/redis_cluster.py`), a `rollout-buffer serve` on
it, a writer retrying each batch until it is answered and a leased reader acking every batch, both running
while the primary that owns the run's slot is SIGKILLed. The replica is promoted (503 "retry" while the
slot is down), the killed node is started again and rejoins as a replica. Afterwards every acknowledged
uid must have been read: `lost` counts those that were not (the window of acknowledged writes a failover
loses), `duplicates` the uids read twice. With `--redis-wait-replicas 1` both must be 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollout_buffer.store import keys
from tests.support.faults import LeasedReader, RetryingWriter, start_daemon
from tests.support.helpers import ServerProcess, make_record, start_run, write_jsonl
from tests.support.redis_cluster import LocalRedisCluster

TASKS = str(Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tasks")


@dataclass
class FailoverResult:
    wait_replicas: int
    acknowledged: int
    read: int
    lost: int
    duplicates: int
    write_retries: int
    read_retries: int
    failover_s: float  # from the kill until a replica serves the slot and the cluster is ok

    def line(self) -> str:
        return (f"failover (--redis-wait-replicas {self.wait_replicas}): {self.acknowledged} writes acknowledged, "
                f"{self.read} read, lost {self.lost}, read twice {self.duplicates}, retried writes "
                f"{self.write_retries}, retried reads {self.read_retries}, failover {self.failover_s:.1f} s")


def run_failover(base: Path, *, wait_replicas: int, records: int = 600, kill_at: float = 0.3,
                 node_timeout_ms: int = 1000, deadline_s: float = 120.0) -> FailoverResult:
    """One failover under load (see the module docstring)."""
    base.mkdir(parents=True, exist_ok=True)
    with LocalRedisCluster(base / "cluster", replicas=1, node_timeout_ms=node_timeout_ms) as cluster:
        flags = ["--redis-url", cluster.url, "--redis-cluster", "--task-dir", TASKS]
        if wait_replicas:
            flags += ["--redis-wait-replicas", str(wait_replicas)]
        input_file = write_jsonl(base / "input.jsonl", [{"instance_id": f"i{i}"} for i in range(records)])
        with ServerProcess(base / "data", *flags) as server:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                run_id = start_run(client, input_file, task_type="external", repeats=1,
                                   run_id=f"failover-{wait_replicas}")
            batch = [make_record(f"i{i}", uid=f"u{i}", run_id=run_id) for i in range(records)]
            writer = RetryingWriter(server.url, run_id, batch, batch_size=4, deadline_s=deadline_s)
            reader = LeasedReader(server.url, run_id, lease_s=60.0, deadline_s=deadline_s)
            threads = [start_daemon(writer.run), start_daemon(reader.run)]
            stop_at = time.monotonic() + deadline_s
            while len(writer.acknowledged) < kill_at * records:
                if time.monotonic() > stop_at:
                    raise RuntimeError(f"writes stalled before the kill: {writer.errors[-3:]}")
                time.sleep(0.01)
            victim = cluster.primary_of_key(keys.run_meta(run_id))
            killed_at = time.monotonic()
            cluster.kill(victim)
            cluster.wait_failover(victim)
            failover_s = time.monotonic() - killed_at
            cluster.restart(victim)  # rejoins as the new primary's replica: writes can reach a replica again
            threads[0].join(timeout=deadline_s)
            reader.stop.set()
            threads[1].join(timeout=deadline_s)
            if any(t.is_alive() for t in threads):
                raise RuntimeError("writer or reader did not finish")
    uids = reader.uids()
    acknowledged = set(writer.acknowledged)
    return FailoverResult(
        wait_replicas=wait_replicas, acknowledged=len(acknowledged), read=len(uids),
        lost=len(acknowledged - set(uids)), duplicates=sum(1 for n in uids.values() if n > 1),
        write_retries=writer.failures, read_retries=reader.failures, failover_s=failover_s)
