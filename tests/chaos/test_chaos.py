"""Exactly-once under random faults: the chaos harness (`bench/chaos/`), short and seeded.

Each test runs `bench.chaos.harness.run_chaos` for 20 s of faults with a fixed seed (the seed that
found a violation replays it: `python -m bench.chaos --seed S`), then asserts what the checker proved over the
whole history: every fault kind landed, and every violation count is 0. What these seeds found before it was
fixed: seed 1 (no longer a round of this file, which runs seed 2 with retention for both claims:
`python -m bench.chaos --seed 1` replays it), a job whose record was written never finished (the rollout's per-epoch counter named a
variable that no longer existed), so a run stalled once a worker was killed; seed 2 with `--retain-runs 1`,
a group stalled for the default 600 s job claim after its worker was SIGKILLed (the harness runs the
server with a short `--task-lease-s`, as an operator with preemptible workers should); seed 3 on the Redis
Cluster, every gateway turn failed (the session store queued a Lua script on a cluster pipeline, which
redis-py refuses), so no agent finished a session. The fast restarts of the fork server
(`bench/chaos/forkserver.py`) found two more: a new API's embedded Redis losing its socket file to the
old server still shutting down (regression test: `tests/store/test_embedded_restart.py`) and an API
restarted every few seconds never answering a `/start_rollout` because each life checked the run's
tokenizer again in a child process (regression test: `tests/runtime/test_worker_processes.py`).

Rate: every kind runs on its own thread with seeded gaps of 0.8-3.6 s (proxy and engine faults, armed
for the next request that takes them, at 0.6x those; trainer kills, which wait for a new checkpoint, at
0.3x), the 10-minute run's rate: about one fault of each
kind every 2.2 s, 11 kinds at once. Faults start once the trainer's first step is trained and last 20 s;
the rounds are smaller than the 10-minute run's (6 prompts x 3 epochs), so the round in flight finishes
soon after the faults stop, and two gateway agents run at once instead of eight, for the load of a CI run.
The gateway agents begin when the faults do: a short round's own rollouts may all be done by the trainer's
first step, and engine faults land only on requests made while they are armed (seed 1 once had no engine
fault land that way, under the load of a full CI run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.chaos.checker import VIOLATIONS, Report
from bench.chaos.harness import ChaosConfig, run_chaos

EMBEDDED_KINDS = {"api_kill", "worker_kill", "redis_kill", "trainer_kill", "proxy_drop", "proxy_cut", "proxy_delay",
                  "engine_error", "engine_timeout", "engine_abort", "policy_bump"}


def _short(tmp_path: Path, **knobs: Any) -> ChaosConfig:
    return ChaosConfig(**{"base": tmp_path / "run", "seconds": 20, "prompts": 6, "epochs": 3, "finish_s": 60,
                          "agent_loops": 2, **knobs})


def _assert_clean(report: Report, kinds: set[str]) -> None:
    print(report.table())
    assert set(report.faults) == kinds
    landed = {kind for kind, n in report.faults.items() if n > 0}
    assert landed == kinds, f"fault kinds that never landed: {sorted(kinds - landed)}"
    assert {kind: report.violations.get(kind, 0) for kind in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0), \
        report.examples
    assert report.counts["groups trained (checkpointed)"] > 0 and report.counts["external records read"] > 0
    assert report.counts["gateway records read"] > 0, "agents trained through gateway sessions too"
    assert report.counts["trainer lives"] > report.counts["rounds"], "the trainer was killed and resumed"


def test_every_fault_at_random_and_every_group_trained_once_with_retention_of_one_run(tmp_path: Path) -> None:
    """`--retain-runs 1`: retired runs (superseded generations of a resumed trainer, finished rounds) are
    deleted as the run goes on, and still no group is trained twice or lost (one round for both claims: a
    round without retention checks nothing this one does not)."""
    report = run_chaos(_short(tmp_path, seed=2, retain_runs=1))
    _assert_clean(report, EMBEDDED_KINDS)


def test_chaos_on_a_redis_cluster_with_replicas_and_primary_kills(tmp_path: Path) -> None:
    """3 primaries + 3 replicas, `--redis-wait-replicas 1`: primaries serving the run are killed (replica
    promoted, the node restarted as a replica), half of them while their replica is paused (SIGSTOP) past
    the 2 s replica wait, among the other faults, at half the rate for 30 s: at the
    full rate the failovers leave the engine almost no rollout to fail within 20 s."""
    report = run_chaos(_short(tmp_path, seed=3, cluster=True, wait_replicas=1, min_gap_s=1.6, max_gap_s=7.2,
                              seconds=30, finish_s=120))
    _assert_clean(report, EMBEDDED_KINDS - {"redis_kill"} | {"primary_kill"})
    assert report.counts["primary kills right after a replica pause past the wait"] > 0, \
        "some primaries died while their replica was paused past the replica wait"


def test_a_round_whose_groups_no_step_takes_is_refused_before_it_runs(tmp_path: Path) -> None:
    # 5 prompts x 1 epoch in steps of 2 groups: the fifth group would be reported lost though the buffer lost nothing
    with pytest.raises(ValueError, match=r"prompts \* epochs \(5 \* 1\) must be a multiple of batch \(2\)"):
        _short(tmp_path, prompts=5, epochs=1)
    assert _short(tmp_path, prompts=5, epochs=2).batch == 2
