"""Evaluation beside a training run (slime's fully-async mode cannot evaluate: its issue #2339).

`generate_rollout(..., evaluation=True)` starts each eval dataset as its own buffer run, never activated,
read by run id: it runs on the same server, workers and engine while the training run goes on, and
touches none of the training run's groups, leases, hand-over counts or staleness accounting. Checked here
on real server state: a training run with workers busy and a leased batch held by the trainer, an
evaluation run to completion beside it, then the training run read to its end.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from slime_adapter.hooks.agent_rollout import generate_rollout
from slime_adapter.reading.buffer_client import ack_batches, fetch_rollout_data, start_rollout
from tests.adapter.test_slime_fields import GROUP, fields_args
from tests.support.helpers import ServerProcess, SlimeLikeDataBuffer, write_jsonl
from tests.support.process_tools import wait_for

LINES = 8
TOOL_S = 0.4  # each training rollout spends this long in its "tool": workers stay busy for a while


def _rows(prefix: str, n: int, tool_s: float) -> list[dict[str, Any]]:
    return [{"instance_id": f"{prefix}{i}", "prompt": f"Compute {i} * 3 with the tool.", "turns": 2,
             "tool_s": tool_s} for i in range(n)]


def training_state(detail: dict[str, Any]) -> dict[str, Any]:
    """What evaluation must not touch: the run's leased and consumed groups, its lease and hand-over
    counters, its policy version and every staleness counter."""
    stats = detail["stats"]
    return {
        "groups": {k: detail["groups"][k] for k in ("leased", "leased_batches", "consumed", "filtered")},
        "leases": detail["leases"],
        "policy_version": detail["meta"].get("policy_version"),
        "consumed_before_version": detail["meta"].get("consumed_before_version"),
        "handed": {k: v for k, v in stats.items() if k.startswith(("batches_", "reads_", "groups_consumed"))},
        "staleness": {k: v for k, v in stats.items() if "stale" in k},
    }


def _read(url: str, run_id: str, policy_version: int = 0,
          **kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One leased read as the trainer makes it (at `policy_version`)."""
    records, meta, _ = asyncio.run(fetch_rollout_data(url, run_id=run_id, lease_s=120,
                                                      policy_version=policy_version, read_format="json", **kwargs))
    return records, meta


def test_evaluation_runs_beside_training_and_touches_nothing_of_it(runtime_server: ServerProcess,
                                                                   rollout_engine: Any, qwen_tokenizer_path: str,
                                                                   tmp_path: Path) -> None:
    url = runtime_server.url
    train = write_jsonl(tmp_path / "train.jsonl", _rows("t", LINES, TOOL_S))
    evals = write_jsonl(tmp_path / "eval.jsonl", _rows("e", 2, 0.0))
    args = fields_args(runtime_server, rollout_engine, qwen_tokenizer_path, train, rollout_num_process=2,
                       use_rollout_routing_replay=False, eval_prompt_data=["quick", str(evals)],
                       n_samples_per_eval_prompt=2)
    run_id = args.agent_rollout_run_id
    start_rollout(url, args, {})
    client = httpx.Client(base_url=url, timeout=30)

    def detail() -> dict[str, Any]:
        return client.get(f"/runs/{run_id}").json()

    # a step done (read at version 0, acknowledged), the policy moved to version 1, and the trainer mid-step:
    # one batch leased at version 1 and not yet acknowledged, the workers busy with the rest
    first, meta = _read(url, run_id, num=GROUP, wait_s=30)
    assert len(first) == GROUP and asyncio.run(ack_batches(url, [meta["batch_id"]], run_id=run_id))
    assert client.post("/policy_version", json={"run_id": run_id, "version": 1}).status_code == 200
    held, meta = _read(url, run_id, num=GROUP, wait_s=30, policy_version=1)
    assert len(held) == GROUP, meta
    busy = detail()
    assert busy["groups"]["leased"] == 1 and busy["groups"]["consumed"] == 1 and busy["meta"]["status"] == "running"
    assert busy["tasks"]["running"] + busy["tasks"]["queued"] > 0, "the training run still has work in flight"
    before = training_state(busy)
    assert before["staleness"] and before["handed"], "the accounting compared is not empty"

    began = time.monotonic()
    output = generate_rollout(args, 0, SlimeLikeDataBuffer(), evaluation=True)
    took = time.monotonic() - began
    data = output.data if hasattr(output, "data") else output
    assert len(data["quick"]["rewards"]) == 2 * 2 and len(data["quick"]["samples"]) == 4

    during = detail()
    assert training_state(during) == before, "evaluation touched the training run's state"
    assert during["tasks"]["running"] > 0 or during["tasks"]["done"] > busy["tasks"]["done"], \
        f"the training run's rollouts went on (not paused) during the {took:.1f} s eval: {during['tasks']}"
    assert client.get("/runs").json()["active_run"] == run_id, "the training run stays the active run"

    # the trainer acknowledges its batch and reads the rest: every group exactly once, nothing of the eval
    handed = {r["instance_id"] for r in first + held}
    acked = asyncio.run(ack_batches(url, [meta["batch_id"]], run_id=run_id))
    assert set(acked.values()) == {"acked"}
    while len(handed) < LINES:
        records, more = _read(url, run_id, wait_s=10, policy_version=1)
        assert records, f"no more groups: {detail()}"
        new = {r["instance_id"] for r in records}
        assert not new & handed, "a group handed twice"
        handed |= new
        asyncio.run(ack_batches(url, [more["batch_id"]], run_id=run_id))
    assert handed == {f"t{i}" for i in range(LINES)}
    wait_for(lambda: detail()["meta"]["status"] == "finished", 30, "the training run finished")
    final = detail()
    assert final["records"]["written"] == LINES * GROUP and final["records"]["duplicates"] == 0
    assert final["groups"]["consumed"] == LINES and final["groups"]["leased"] == 0
    leases = final["leases"]
    assert leases["batches_acked"] == leases["batches_leased"] and leases["lease_expired"] == 0
    assert final["stats"].get("stale_requeued_groups", 0) == 0 and final["stats"].get("stale_dropped_groups", 0) == 0
    assert final["failures"]["total"] == 0, "no training rollout was aborted or failed by the evaluation"
