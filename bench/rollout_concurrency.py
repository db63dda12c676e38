"""Rollout concurrency: 1024 three-turn rollouts in flight at once against the test engine at a fixed
latency (0.5 s), through the whole runtime, against a bare client doing the same engine calls.

Ours: a `rollout-buffer serve` with its default worker processes (one per core, at most 8; embedded Redis)
runs the rollouts, from `/start_rollout` to the last record read. Baseline, measured in the same run:
plain aiohttp tasks replaying exactly the `/generate` calls our run made (`bench/bare_client.py`), at the
same concurrency, with no runtime. The ideal engine call rate is concurrency / latency. Printed: both
rates, the ratio ours / baseline (the target, >= 0.9), both against the ideal, the peak of the summed RSS
of every buffer process (API, worker processes, Redis; target <= 600 MB) sampled during the run, and the
CPU time per engine call of each process kind, which bounds the rate on a small machine: all processes
share the cores, so the run takes at least engine calls x (total CPU per call) / cores.

A warm-up run first makes every worker process load the tokenizer, so the timed runs measure rollouts,
not start-up. Each round is our run, then the bare replay of its calls; the best time of each side over
the rounds (3; 1 with --quick) counts. The machine's load average is printed with the result: on a
shared machine it explains noise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.bare_client import replay_requests, run_baseline
from bench.procs import RssSampler, cmdline, cpu_seconds, tree
from rollout_buffer.settings import usable_cores

REPO = Path(__file__).resolve().parent.parent
TASKS = Path(__file__).resolve().parent / "tasks"
TURNS = 3
SAMPLING = {"max_tokens": 256}
WORKER_MARK = "rollout_buffer.runtime.supervisor"  # how a supervised worker process's command line reads


def _wait_for(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_BUFFER_WORKER_PROCESSES"}  # the real default
    with open(log, "ab") as handle:
        return subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", *args], cwd=REPO, env=env,
                                stdout=handle, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_and_wait(client: httpx.Client, body: dict[str, Any], rollouts: int,
                  timeout_s: float) -> tuple[float, list[dict[str, Any]]]:
    """Start a run, long-poll its records until all arrived; returns (seconds from start to last record,
    the records)."""
    started = time.perf_counter()
    response = client.post("/start_rollout", json=body)
    response.raise_for_status()
    run_id = response.json()["run_id"]
    records: list[dict[str, Any]] = []
    while len(records) < rollouts:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"only {len(records)}/{rollouts} rollouts in {timeout_s}s: "
                               f"{client.get(f'/runs/{run_id}').json()}")
        answer = client.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 1.0}).json()
        batch = answer["data"]["data"]
        bad = [r for r in batch if r.get("status") != "completed"]
        if bad:
            raise RuntimeError(f"rollouts failed: {bad[0].get('extra_info')}")
        records.extend(batch)
    return time.perf_counter() - started, records


def _engine_stats(engine_url: str) -> dict[str, Any]:
    return httpx.get(f"{engine_url}/_test/stats").json()


def _round(client: httpx.Client, body: dict[str, Any], engine_url: str, buffer_pids: list[int], engine_pid: int,
           rollouts: int, concurrency: int, run_id: str) -> dict[str, Any]:
    """One measured round: our run, then the bare client replaying exactly its engine calls."""
    from rollout_buffer.runtime.options import sglang_sampling_params
    from rollout_buffer.wire.schema import StartRolloutRequest

    httpx.post(f"{engine_url}/_test/reset_stats")
    cpu_before = {pid: cpu_seconds(pid) for pid in [*buffer_pids, engine_pid]}
    with RssSampler(buffer_pids) as rss:
        seconds, records = _run_and_wait(client, {**body, "num_process": concurrency, "run_id": run_id}, rollouts, 600)
    cpu_used = {pid: cpu_seconds(pid) - before for pid, before in cpu_before.items()}
    retries = client.get(f"/runs/{run_id}").json()["stats"].get("engine_retries", 0)
    stats = _engine_stats(engine_url)
    httpx.post(f"{engine_url}/_test/reset_stats")
    params = sglang_sampling_params(StartRolloutRequest(task_type="x", input_file="x", sampling_params=SAMPLING))
    base_seconds, base_calls = run_baseline(engine_url, replay_requests(records, params), concurrency)
    base_stats = _engine_stats(engine_url)
    if base_calls != stats["requests"] or base_stats["generated_tokens"] != stats["generated_tokens"]:
        raise RuntimeError(f"the baseline did not replay the same work: {base_calls} calls, "
                           f"{base_stats['generated_tokens']} tokens vs ours {stats['requests']}, "
                           f"{stats['generated_tokens']}")
    return {"seconds": seconds, "baseline_seconds": base_seconds, "calls": stats["requests"], "retries": retries,
            "max_in_flight": stats["max_in_flight"], "cpu_used": cpu_used, "rss_peak_kib": rss.peak_kib,
            "rss_by_pid": rss.peak_by_pid}


def run(quick: bool = False, *, rollouts: int | None = None, concurrency: int | None = None,
        latency_s: float | None = None, worker_processes: int | None = None,
        rounds: int | None = None) -> dict[str, Any]:
    """Returns the measurement as a dict; `quick` runs 256 rollouts at 256 concurrency, 0.2 s latency, one
    round. A round is our run then the bare replay of its calls; the best of each over the rounds counts (the
    least disturbed by whatever else the machine runs), the peak RSS is the largest of any round."""
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    rollouts = rollouts or (256 if quick else 1024)
    concurrency = concurrency or rollouts
    latency_s = latency_s if latency_s is not None else (0.2 if quick else 0.5)
    rounds = rounds or (1 if quick else 3)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rb-bench-") as tmp:
        work = Path(tmp)
        engine_port, server_port = _free_port(), _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--latency-s", str(latency_s), "--seed", "1"],
                        work / "engine.log")
        processes_flag = [] if worker_processes is None else ["--worker-processes", str(worker_processes)]
        server = _spawn(["serve", "--port", str(server_port), "--data-dir", str(work / "data"), *processes_flag,
                         "--task-dir", str(TASKS), "--log-level", "warning", "--input-root", str(work),
                         "--input-root", str(qwen_tokenizer_dir("qwen2.5"))], work / "server.log")
        try:
            engine_url, server_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{server_port}"
            _wait_for(f"{engine_url}/health", engine)
            _wait_for(f"{server_url}/health", server)
            workers = [pid for pid in tree(server.pid) if WORKER_MARK in cmdline(pid)]
            rows = [{"instance_id": f"b{i}", "prompt": f"What is {i} + {i * 7 + 3}?",
                     "follow_up": f"And what is {i} * 3 - 1?"} for i in range(rollouts)]
            (work / "input.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            warm = max(1, len(workers)) * 4
            (work / "warmup.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows[:warm]))
            body = {"task_type": "bench_three_turn", "num_repeat_per_sample": 1, "num_epoch": 1,
                    "remote_engine_url": engine_url, "tokenizer_path": str(qwen_tokenizer_dir("qwen2.5")),
                    "sampling_params": SAMPLING, "engine_timeout_s": 120}
            with httpx.Client(base_url=server_url, timeout=120) as client:
                # every worker process gets a share of the warm-up, so each has loaded the tokenizer
                _run_and_wait(client, {**body, "input_file": str(work / "warmup.jsonl"), "num_process": warm,
                                       "run_id": "warmup"}, warm, 120)
                buffer_pids = tree(server.pid)
                measured = [_round(client, {**body, "input_file": str(work / "input.jsonl")}, engine_url, buffer_pids,
                                   engine.pid, rollouts, concurrency, f"bench{i}") for i in range(rounds)]
            redis_pid = int((work / "data" / "redis.pid").read_text())
        finally:
            for proc in (server, engine):
                _stop(proc)
    best = min(measured, key=lambda m: m["seconds"])
    calls = best["calls"]
    kind = {pid: ("workers" if pid in workers else "redis" if pid == redis_pid else "server") for pid in buffer_pids}
    kind[engine.pid] = "engine"
    cpu_ms: dict[str, float] = {}
    for pid, used in best["cpu_used"].items():
        cpu_ms[kind[pid]] = cpu_ms.get(kind[pid], 0.0) + 1000 * used / max(calls, 1)
    fullest = max(measured, key=lambda m: m["rss_peak_kib"])
    rss_mb: dict[str, float] = {}
    for pid, kib in fullest["rss_by_pid"].items():
        rss_mb[kind.get(pid, "server")] = rss_mb.get(kind.get(pid, "server"), 0.0) + kib * 1024 / 1e6
    seconds, base_seconds = best["seconds"], min(m["baseline_seconds"] for m in measured)
    achieved, baseline = calls / seconds, calls / base_seconds
    ideal = concurrency / latency_s
    cores = usable_cores()
    total_ms = sum(cpu_ms.values())
    ideal_s = TURNS * latency_s * -(-rollouts // concurrency)
    return {
        "rollouts": rollouts, "concurrency": concurrency, "latency_s": latency_s, "turns": TURNS,
        "worker_processes": len(workers), "engine_calls": calls, "engine_retries": best["retries"],
        "rounds": [{"seconds": m["seconds"], "baseline_seconds": m["baseline_seconds"]} for m in measured],
        "seconds": seconds, "calls_per_s": achieved, "baseline_seconds": base_seconds,
        "baseline_calls_per_s": baseline, "ideal_calls_per_s": ideal, "ideal_seconds": ideal_s,
        "ratio": achieved / baseline, "ratio_to_ideal": achieved / ideal, "baseline_to_ideal": baseline / ideal,
        "engine_max_in_flight": best["max_in_flight"],
        "peak_rss_mb": fullest["rss_peak_kib"] * 1024 / 1e6, "rss_mb_at_peak": rss_mb,
        "cpu_ms_per_call": cpu_ms, "cpu_ms_per_call_total": total_ms, "cpu_cores": cores,
        "cpu_bound_seconds": calls * total_ms / 1000 / cores,
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 rollouts at 0.2 s latency")
    parser.add_argument("--rollouts", type=int, help="rollouts in the run (default 1024)")
    parser.add_argument("--concurrency", type=int, help="num_process: rollouts in flight (default = rollouts)")
    parser.add_argument("--latency-s", type=float, help="test engine latency per call (default 0.5)")
    parser.add_argument("--worker-processes", type=int, help="serve's --worker-processes (default: its own)")
    parser.add_argument("--rounds", type=int, help="measured rounds, best of each side counts (default 3; quick 1)")
    args = parser.parse_args(argv)
    r = run(args.quick, rollouts=args.rollouts, concurrency=args.concurrency, latency_s=args.latency_s,
            worker_processes=args.worker_processes, rounds=args.rounds)
    print(f"{r['rollouts']} rollouts x {r['turns']} turns, {r['concurrency']} in flight, engine latency "
          f"{r['latency_s']:g}s, {r['worker_processes']} worker process(es): {r['engine_calls']} engine calls in "
          f"{r['seconds']:.2f}s (bare client {r['baseline_seconds']:.2f}s, ideal {r['ideal_seconds']:.2f}s)")
    print(f"engine calls/s: ours {r['calls_per_s']:.0f}, bare client {r['baseline_calls_per_s']:.0f}, ideal "
          f"{r['ideal_calls_per_s']:.0f} -> ours/bare {r['ratio']:.2f} (target >= 0.9), ours/ideal "
          f"{r['ratio_to_ideal']:.2f}, bare/ideal {r['baseline_to_ideal']:.2f}; engine peak in flight "
          f"{r['engine_max_in_flight']}, engine retries {r['engine_retries']}")
    print(f"peak RSS of all buffer processes {r['peak_rss_mb']:.0f} MB (target <= 600): "
          + ", ".join(f"{name} {mb:.0f}" for name, mb in r["rss_mb_at_peak"].items()))
    total = r["cpu_ms_per_call_total"]
    print("CPU ms per engine call: " + ", ".join(f"{name} {value:.2f}" for name, value in r["cpu_ms_per_call"].items())
          + f" (total {total:.2f} ms -> at most ~{1000 * r['cpu_cores'] / total:.0f} calls/s on {r['cpu_cores']} "
            f"cores; >= {r['cpu_bound_seconds']:.2f}s for this run)")
    print("rounds (ours / bare client, s): " + ", ".join(f"{m['seconds']:.2f} / {m['baseline_seconds']:.2f}"
                                                       for m in r["rounds"]))
    print(f"load average (1 min): {r['load_average']['before']:.2f} before, {r['load_average']['after']:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
