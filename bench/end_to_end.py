"""End to end: groups/s from `/start_rollout` to slime `Sample`s through the adapter, against the sum
of the same stages measured alone in the same run (generation, reading, sample building).

Everything is real: a `rollout-buffer serve` process (embedded Redis, in-process workers), the test
engine as its own process at zero latency, the built-in `math` task, and the adapter's
`generate_agent_rollout` with a slime-like data buffer. The ratio is (t_generate + t_read + t_build) /
t_end_to_end: >= 1 means composing the stages costs nothing extra (they may even overlap).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

GROUP_SIZE = 8
REPS = 3  # each side's best of 3: a run of 128 groups lasts under a second, other jobs on the machine disturb it


def _args(buffer_url: str, engine_url: str, input_file: Path, prompts: int, run_id: str) -> SimpleNamespace:
    return SimpleNamespace(
        agent_rollout_buffer_url=buffer_url, prompt_data=str(input_file), rollout_task_type="math",
        n_samples_per_prompt=GROUP_SIZE, rollout_batch_size=prompts, num_epoch=1,
        hf_checkpoint=str(qwen_tokenizer_dir("qwen2.5")), rollout_max_response_len=256,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_num_process=256, agent_rollout_run_id=run_id,
        agent_fetch_backoff_s=0.05, agent_fetch_backoff_max_s=0.2,
        sglang_router_ip=engine_url.rsplit(":", 1)[0].removeprefix("http://"),
        sglang_router_port=int(engine_url.rsplit(":", 1)[1]), use_wandb=False, loss_mask_type="qwen",
        disable_rewards_normalization=False, fetch_trajectory_retry_times=-1,
    )


def _wait_completed(client: httpx.Client, run_id: str, groups: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get(f"/runs/{run_id}").json()["groups"]["completed"] >= groups:
            return
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id} did not complete {groups} groups in {timeout_s}s")


def _stages_alone(buffer_url: str, args: SimpleNamespace, prompts: int) -> dict[str, float]:
    from slime_adapter.hooks.agent_rollout import build_start_payload, split_groups
    from slime_adapter.reading.buffer_client import get_rollout_data
    from slime_adapter.samples.build import build_group_samples
    from slime_adapter.settings import AgentRolloutSettings

    settings = AgentRolloutSettings.from_args(args)
    with httpx.Client(base_url=buffer_url, timeout=120) as client:
        started = time.perf_counter()
        run_id = client.post("/start_rollout", json=build_start_payload(settings, {})).json()["run_id"]
        _wait_completed(client, run_id, prompts)
        t_generate = time.perf_counter() - started

    async def read_all() -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        while len(records) < prompts * GROUP_SIZE:
            data, _ = await get_rollout_data(buffer_url, timeout=30.0, run_id=run_id)
            records.extend(data)
        return records

    started = time.perf_counter()
    records = asyncio.run(read_all())
    t_read = time.perf_counter() - started
    started = time.perf_counter()
    samples = [build_group_samples(group, lambda: None, "qwen") for group in split_groups(records)]
    t_build = time.perf_counter() - started
    assert len(samples) == prompts
    return {"generate_s": t_generate, "read_s": t_read, "build_s": t_build}


def _end_to_end(args: SimpleNamespace, prompts: int) -> float:
    from slime_adapter.hooks.agent_rollout import generate_rollout, reset_state

    reset_state()
    from tests.support.helpers import SlimeLikeDataBuffer

    data_buffer = SlimeLikeDataBuffer()
    started = time.perf_counter()
    groups = generate_rollout(args, 0, data_buffer)
    elapsed = time.perf_counter() - started
    assert len(groups) == prompts and all(len(g) == GROUP_SIZE for g in groups)
    return elapsed


def run(quick: bool = False) -> dict[str, Any]:
    from tests.support.helpers import ServerProcess, free_port, write_jsonl

    prompts = 32 if quick else 128
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        rows = [{"instance_id": f"q{i}", "prompt": f"What is {i} + {i + 3}?", "label": str(2 * i + 3)}
                for i in range(prompts)]
        input_file = write_jsonl(tmp_path / "math.jsonl", rows)
        warm_file = write_jsonl(tmp_path / "warm.jsonl", rows[:2])
        port = free_port()
        engine = subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", "test-engine", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{engine_url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.05)
            with ServerProcess(tmp_path / "data", "--workers", "1") as server:
                tag = str(int(time.time() * 1000))
                _end_to_end(_args(server.url, engine_url, warm_file, 2, f"warm-{tag}"), 2)  # load everything once
                # interleaved repetitions, best of each, so neither side carries the other's warm-up
                stage_runs: list[dict[str, float]] = []
                e2e_runs: list[float] = []
                for rep in range(REPS):  # which side goes first alternates
                    for side in ("stages", "e2e") if rep % 2 == 0 else ("e2e", "stages"):
                        args = _args(server.url, engine_url, input_file, prompts, f"{side}{rep}-{tag}")
                        if side == "stages":
                            stage_runs.append(_stages_alone(server.url, args, prompts))
                        else:
                            e2e_runs.append(_end_to_end(args, prompts))
                stages = min(stage_runs, key=lambda s: sum(s.values()))
                e2e = min(e2e_runs)
        finally:
            engine.terminate()
            engine.wait(timeout=30)
    total = sum(stages.values())
    return {"groups": prompts, **stages, "stages_sum_s": total, "end_to_end_s": e2e,
            "groups_per_s": prompts / e2e, "stages_groups_per_s": prompts / total, "ratio": total / e2e,
            "end_to_end_runs_s": e2e_runs, "stages_runs_s": [sum(s.values()) for s in stage_runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args(argv).quick)
    print(f"end to end: {r['groups']} groups x {GROUP_SIZE}: {r['groups_per_s']:.1f} groups/s vs stages alone "
          f"{r['stages_groups_per_s']:.1f} groups/s (generate {r['generate_s']:.2f}s + read {r['read_s']:.2f}s + "
          f"build {r['build_s']:.2f}s) -> {r['ratio']:.2f}x (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
