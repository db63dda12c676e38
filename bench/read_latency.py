"""Read cost vs backlog: `/get_rollout_data` latency for 128 ready groups x 8, with few and with 100x
more incomplete groups pending. Both measured in the same run against the same server, the trials of the
two backlogs alternating (few, many, few, many, ...) so order and warm-up cannot favour either; the ratio
is of the medians.

The server is a real `rollout-buffer serve` process on the embedded Redis. Incomplete groups are written
straight into its Redis through the same store code the API uses (fast to set up); the timed reads go
over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from rollout_buffer.store.store import Store

GROUPS, GROUP_SIZE = 128, 8


def _record(instance_id: str, uid: str, tokens: int = 256) -> dict[str, Any]:
    prompt = list(range(1000, 1000 + tokens // 2))
    output = list(range(2000, 2000 + tokens // 2))
    return {
        "uid": uid, "instance_id": instance_id, "reward": 1.0, "extra_info": {}, "status": "completed",
        "messages": [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "a" * 200}],
        "turns": [{"prompt_ids": prompt, "output_ids": output, "output_logprobs": [-0.5] * len(output),
                   "finish_reason": "stop", "weight_version": "1"}],
    }


async def _write_many(store: Store, run_id: str, records: list[dict[str, Any]], concurrency: int = 256) -> None:
    for start in range(0, len(records), concurrency):
        await asyncio.gather(*(store.write_record(run_id, r) for r in records[start:start + concurrency]))


async def _trial(store: Store, client: httpx.AsyncClient, run_id: str, tag: str) -> float:
    ready = [_record(f"{tag}-g{g}", f"{tag}-g{g}-{m}") for g in range(GROUPS) for m in range(GROUP_SIZE)]
    await _write_many(store, run_id, ready)
    started = time.perf_counter()
    answer = (await client.post("/get_rollout_data", json={"run_id": run_id})).json()
    elapsed = time.perf_counter() - started
    assert len(answer["data"]["data"]) == GROUPS * GROUP_SIZE, answer["message"]
    return elapsed


async def _run_async(url: str, redis_url: str, input_file: Path, few: int, many: int, trials: int) -> dict[str, Any]:
    store = Store.from_url(redis_url)
    backlogs = {"few": few, "many": many}
    runs: dict[str, str] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for label, pending in backlogs.items():
            run = await client.post("/start_rollout", json={
                "task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": GROUP_SIZE,
                "run_id": f"bench-read-{label}-{int(time.time() * 1000)}"})
            runs[label] = run.json()["run_id"]
            await _write_many(store, runs[label], [_record(f"pending-{i}", f"p-{i}") for i in range(pending)])
        timings: dict[str, list[float]] = {"few": [], "many": []}
        for trial in range(trials):
            for label in ("few", "many"):
                timings[label].append(await _trial(store, client, runs[label], f"t{trial}"))
    await store.close()
    results: dict[str, Any] = {label: {"pending_groups": backlogs[label], "median_s": statistics.median(t),
                                       "timings_s": t} for label, t in timings.items()}
    results["ratio"] = results["many"]["median_s"] / results["few"]["median_s"]
    return results


def run(quick: bool = False) -> dict[str, Any]:
    """Returns {few, many, ratio}; `quick` keeps the 100x backlog ratio at a smaller size."""
    from tests.support.helpers import ServerProcess, write_jsonl

    few, many, trials = (1_000, 100_000, 7) if not quick else (500, 50_000, 5)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "x"}])
        tasks = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tasks"
        with ServerProcess(tmp_path / "data", "--task-dir", str(tasks)) as server:
            redis_url = f"unix://{(tmp_path / 'data' / 'redis.sock').resolve()}"
            return asyncio.run(_run_async(server.url, redis_url, input_file, few, many, trials))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(f"read {GROUPS} groups x {GROUP_SIZE}: {result['few']['pending_groups']:>7} pending "
          f"{result['few']['median_s'] * 1000:7.1f} ms | {result['many']['pending_groups']:>7} pending "
          f"{result['many']['median_s'] * 1000:7.1f} ms | ratio {result['ratio']:.2f} (target <= 1.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
