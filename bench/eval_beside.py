"""Evaluation beside training: the training run's throughput (groups/s handed to the trainer) while an
evaluation runs, against the same run's throughput without one (slime's fully-async mode cannot evaluate at
all: its issue #2339).

Everything is real: a `rollout-buffer serve` process (embedded Redis, in-process workers), the test engine as
its own process at a fixed latency, the three-turn benchmark task, and the adapter: a trainer thread calls
`generate_rollout(args, step, data_buffer)` step after step (small steps, so the rate is seen finely), and
the main thread calls `generate_rollout(args, step, data_buffer, evaluation=True)` once, which starts the
eval dataset as its own run beside the training run and returns when it is done. Windows: the training
run's rate in a window before the evaluation and one after it (the baseline: their mean, same run), and
during the evaluation; the ratio is during / baseline. The evaluation shares the server's CPU, the workers
and the engine with the training run, so on a 2-core machine it costs the training run that CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

TASKS = Path(__file__).resolve().parent / "tasks"
GROUP_SIZE = 2
STEP_GROUPS = 4  # groups per trainer step


def _args(buffer_url: str, engine_url: str, input_file: Path, run_id: str, concurrency: int,
          **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(
        agent_rollout_buffer_url=buffer_url, prompt_data=str(input_file), rollout_task_type="bench_three_turn",
        n_samples_per_prompt=GROUP_SIZE, rollout_batch_size=STEP_GROUPS, num_epoch=1,
        hf_checkpoint=str(qwen_tokenizer_dir("qwen2.5")), rollout_max_response_len=64, rollout_temperature=1.0,
        rollout_top_p=1.0, rollout_num_process=concurrency, agent_rollout_run_id=run_id,
        agent_fetch_backoff_s=0.05, agent_fetch_backoff_max_s=0.2,
        sglang_router_ip=engine_url.rsplit(":", 1)[0].removeprefix("http://"),
        sglang_router_port=int(engine_url.rsplit(":", 1)[1]), use_wandb=False, loss_mask_type="qwen",
        disable_rewards_normalization=False, fetch_trajectory_retry_times=-1, **extra)


class Trainer(threading.Thread):
    """slime's training loop as far as rollouts go: one `generate_rollout` step after another; each step's
    groups are counted when it returns."""

    def __init__(self, args: SimpleNamespace) -> None:
        super().__init__(name="bench-trainer", daemon=True)
        self.args = args
        self.steps: list[tuple[float, int]] = []  # (time the step returned, groups)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from slime_adapter.hooks.agent_rollout import generate_rollout
        from tests.support.helpers import SlimeLikeDataBuffer

        buffer = SlimeLikeDataBuffer()
        step = 0
        try:
            while not self.stop.is_set():
                groups = generate_rollout(self.args, step, buffer)
                self.steps.append((time.monotonic(), len(groups)))
                step += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def rate(self, start: float, end: float) -> float:
        """Groups handed to the trainer per second in [start, end)."""
        return sum(n for t, n in self.steps if start <= t < end) / (end - start)


def _engine(port: int, latency_s: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", "test-engine", "--port", str(port),
                             "--latency-s", str(latency_s), "--seed", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
        time.sleep(0.05)


def run(quick: bool = False, *, window_s: float | None = None, eval_prompts: int | None = None,
        concurrency: int = 32, latency_s: float = 0.1) -> dict[str, Any]:
    """Returns the measurement as a dict (see the module docstring)."""
    from slime_adapter.hooks.agent_rollout import generate_rollout, reset_state
    from tests.support.helpers import ServerProcess, SlimeLikeDataBuffer, free_port, write_jsonl

    window_s = window_s or (4.0 if quick else 10.0)
    eval_prompts = eval_prompts or (48 if quick else 128)
    eval_n = 4
    lines = 20_000  # more than the training run can roll out in the benchmark's time
    reset_state()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rb-bench-eval-") as tmp:
        work = Path(tmp)
        rows = [{"instance_id": f"t{i}", "prompt": f"What is {i} + {i * 7 + 3}?",
                 "follow_up": f"And what is {i} * 3 - 1?"} for i in range(lines)]
        train_file = write_jsonl(work / "train.jsonl", rows)
        eval_file = write_jsonl(work / "eval.jsonl", [{**r, "instance_id": f"e{i}"}
                                                      for i, r in enumerate(rows[:eval_prompts])])
        port = free_port()
        engine = _engine(port, latency_s)
        engine_url = f"http://127.0.0.1:{port}"
        try:
            with ServerProcess(work / "data", "--workers", "1", "--task-dir", str(TASKS)) as server:
                args = _args(server.url, engine_url, train_file, f"train-{int(time.time() * 1000)}", concurrency,
                             eval_prompt_data=["bench_eval", str(eval_file)], n_samples_per_eval_prompt=eval_n)
                trainer = Trainer(args)
                trainer.start()
                time.sleep(window_s / 2)  # warm-up: the run started, tokenizers loaded, steps flowing
                before = (time.monotonic(), time.monotonic() + window_s)
                time.sleep(window_s)
                began = time.monotonic()
                output = generate_rollout(args, 0, SlimeLikeDataBuffer(), evaluation=True)
                ended = time.monotonic()
                time.sleep(window_s)
                after = (ended, ended + window_s)
                trainer.stop.set()
                trainer.join(timeout=120)
                if trainer.error is not None:
                    raise RuntimeError(f"the training loop failed: {trainer.error!r}") from trainer.error
        finally:
            engine.terminate()
            engine.wait(timeout=30)
    data = output.data if hasattr(output, "data") else output
    rewards = data["bench_eval"]["rewards"]
    if len(rewards) != eval_prompts * eval_n:
        raise RuntimeError(f"the evaluation returned {len(rewards)} rewards, not {eval_prompts * eval_n}")
    rate_before, rate_after = trainer.rate(*before), trainer.rate(*after)
    baseline = (rate_before + rate_after) / 2
    during = trainer.rate(began, ended)
    return {
        "concurrency": concurrency, "latency_s": latency_s, "group_size": GROUP_SIZE, "step_groups": STEP_GROUPS,
        "window_s": window_s, "eval_rollouts": len(rewards), "eval_seconds": ended - began,
        "eval_rollouts_per_s": len(rewards) / (ended - began), "groups_per_s_before": rate_before,
        "groups_per_s_after": rate_after, "baseline_groups_per_s": baseline, "groups_per_s_during_eval": during,
        "ratio": during / baseline if baseline else 0.0, "trainer_steps": len(trainer.steps),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
    }


def line(r: dict[str, Any]) -> str:
    """The result in one line: the ratio and its baseline."""
    return (f"training run during evaluation: {r['groups_per_s_during_eval']:.1f} groups/s vs "
            f"{r['baseline_groups_per_s']:.1f} groups/s without (same run: {r['groups_per_s_before']:.1f} before, "
            f"{r['groups_per_s_after']:.1f} after) = {r['ratio']:.2f}x, while {r['eval_rollouts']} eval rollouts ran "
            f"in {r['eval_seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 s windows, 48 eval prompts")
    parser.add_argument("--window-s", type=float, help="length of the windows before and after (default 10)")
    parser.add_argument("--eval-prompts", type=int, help="eval prompts, 4 samples each (default 128)")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts in flight per run (default 32)")
    parser.add_argument("--latency-s", type=float, default=0.1, help="test engine latency per call (default 0.1)")
    args = parser.parse_args(argv)
    print(line(run(args.quick, window_s=args.window_s, eval_prompts=args.eval_prompts,
                   concurrency=args.concurrency, latency_s=args.latency_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
