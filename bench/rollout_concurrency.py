"""Rollout concurrency: 1024 three-turn rollouts in flight at once against the test engine at a fixed
latency (0.5 s). The ideal engine call rate is concurrency / latency; the benchmark prints the achieved
rate, the ratio to the ideal, the engine's peak in-flight count, the worker's peak RSS, and the CPU time per
engine call of each process (worker, test engine, server, Redis), which bounds the rate on a small machine.

Two bounds explain a shortfall by numbers. All processes share the machine's cores: the run takes at least
engine calls x (total CPU per call) / cores. And the worker is one process, on one core, doing every call's
client work: all rollouts start together, so sending the first turn of all of them takes concurrency x
(worker CPU per call), the last rollout starts that much late, and the run takes at least that stagger plus
turns x latency.

Processes: the test engine, a `rollout-buffer serve --workers 0` (embedded Redis), and one
`rollout-buffer worker` (the measured one). A one-rollout warm-up run loads the tokenizer first, so the
timed run measures rollouts, not start-up.
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

REPO = Path(__file__).resolve().parent.parent
TASKS = Path(__file__).resolve().parent / "tasks"


def _proc_status(pid: int, field: str) -> int:
    """A `VmHWM`-style field of /proc/<pid>/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    with open(log, "ab") as handle:
        return subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", *args], cwd=REPO, stdout=handle,
                                stderr=subprocess.STDOUT)


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


def _run_and_wait(client: httpx.Client, body: dict[str, Any], rollouts: int, timeout_s: float) -> float:
    """Start a run, long-poll its records until all arrived; returns the seconds from start to last record."""
    started = time.perf_counter()
    response = client.post("/start_rollout", json=body)
    response.raise_for_status()
    run_id = response.json()["run_id"]
    got = 0
    while got < rollouts:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"only {got}/{rollouts} rollouts in {timeout_s}s: {client.get(f'/runs/{run_id}').json()}")
        answer = client.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 1.0}).json()
        records = answer["data"]["data"]
        bad = [r for r in records if r.get("status") != "completed"]
        if bad:
            raise RuntimeError(f"rollouts failed: {bad[0].get('extra_info')}")
        got += len(records)
    return time.perf_counter() - started


def run(quick: bool = False, *, rollouts: int | None = None, concurrency: int | None = None,
        latency_s: float | None = None) -> dict[str, Any]:
    """Returns the measurement as a dict; `quick` runs 256 rollouts at 256 concurrency, 0.2 s latency."""
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    rollouts = rollouts or (256 if quick else 1024)
    concurrency = concurrency or rollouts
    latency_s = latency_s if latency_s is not None else (0.2 if quick else 0.5)
    turns = 3
    with tempfile.TemporaryDirectory(prefix="rb-bench-") as tmp:
        work = Path(tmp)
        engine_port, server_port = _free_port(), _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--latency-s", str(latency_s), "--seed", "1"],
                        work / "engine.log")
        server = _spawn(["serve", "--port", str(server_port), "--data-dir", str(work / "data"), "--workers", "0",
                         "--task-dir", str(TASKS), "--log-level", "warning", "--input-root", str(work),
                         "--input-root", str(qwen_tokenizer_dir("qwen2.5"))], work / "server.log")
        worker: subprocess.Popen[bytes] | None = None
        try:
            engine_url, server_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{server_port}"
            _wait_for(f"{engine_url}/health", engine)
            _wait_for(f"{server_url}/health", server)
            worker = _spawn(["worker", "--data-dir", str(work / "data"), "--task-dir", str(TASKS),
                             "--log-level", "warning"], work / "worker.log")
            rows = [{"instance_id": f"b{i}", "prompt": f"What is {i} + {i * 7 + 3}?",
                     "follow_up": f"And what is {i} * 3 - 1?"} for i in range(rollouts)]
            (work / "input.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            (work / "warmup.jsonl").write_bytes(orjson.dumps(rows[0]) + b"\n")
            body = {"task_type": "bench_three_turn", "num_repeat_per_sample": 1, "num_epoch": 1,
                    "remote_engine_url": engine_url, "tokenizer_path": str(qwen_tokenizer_dir("qwen2.5")),
                    "sampling_params": {"max_tokens": 256}, "engine_timeout_s": 120}
            with httpx.Client(base_url=server_url, timeout=120) as client:
                _run_and_wait(client, {**body, "input_file": str(work / "warmup.jsonl"), "num_process": 1,
                                       "run_id": "warmup"}, 1, 120)
                httpx.post(f"{engine_url}/_test/reset_stats")
                pids = {"worker": worker.pid, "engine": engine.pid, "server": server.pid,
                        "redis": int((work / "data" / "redis.pid").read_text())}
                cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
                seconds = _run_and_wait(client, {**body, "input_file": str(work / "input.jsonl"),
                                                 "num_process": concurrency, "run_id": "bench"}, rollouts, 600)
                cpu = {name: _cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
                peak_rss_kib = _proc_status(worker.pid, "VmHWM")
            stats = httpx.get(f"{engine_url}/_test/stats").json()
        finally:
            for proc in (worker, server, engine):
                if proc is not None:
                    _stop(proc)
    calls = stats["requests"]
    achieved = calls / seconds
    ideal = concurrency / latency_s
    cores = os.cpu_count() or 1
    per_call = {name: 1000 * value / max(calls, 1) for name, value in cpu.items()}
    total_ms = sum(per_call.values())
    worker_ms = per_call["worker"]
    # The best these CPU costs allow: the cores shared by all processes, and one worker process that needs
    # concurrency x its CPU per call to send one turn of every rollout, a stagger that every turn carries.
    ideal_s = turns * latency_s * -(-rollouts // concurrency)
    cpu_bound_s = calls * total_ms / 1000 / cores
    worker_bound_s = ideal_s + concurrency * worker_ms / 1000
    bound_s = max(ideal_s, cpu_bound_s, worker_bound_s)
    return {
        "rollouts": rollouts, "concurrency": concurrency, "latency_s": latency_s, "turns": turns,
        "engine_calls": calls, "seconds": seconds, "calls_per_s": achieved, "ideal_calls_per_s": ideal,
        "ratio": achieved / ideal, "engine_max_in_flight": stats["max_in_flight"],
        "peak_rss_mb": peak_rss_kib * 1024 / 1e6, "worker_peak_rss_mib": peak_rss_kib / 1024,
        "cpu_ms_per_call": per_call, "cpu_ms_per_call_total": total_ms,
        "cpu_cores": cores,
        "ideal_seconds": ideal_s,
        "cpu_bound_seconds": cpu_bound_s, "worker_bound_seconds": worker_bound_s,
        "bound_ratio": min(1.0, (calls / bound_s) / ideal),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="256 rollouts at 0.2 s latency")
    parser.add_argument("--rollouts", type=int, help="rollouts in the run (default 1024)")
    parser.add_argument("--concurrency", type=int, help="num_process: rollouts in flight (default = rollouts)")
    parser.add_argument("--latency-s", type=float, help="test engine latency per call (default 0.5)")
    args = parser.parse_args(argv)
    r = run(args.quick, rollouts=args.rollouts, concurrency=args.concurrency, latency_s=args.latency_s)
    print(f"{r['rollouts']} rollouts x {r['turns']} turns, {r['concurrency']} in flight, engine latency "
          f"{r['latency_s']:g}s: {r['engine_calls']} engine calls in {r['seconds']:.2f}s "
          f"(ideal {r['ideal_seconds']:.2f}s)")
    print(f"engine calls/s {r['calls_per_s']:.0f} vs ideal {r['ideal_calls_per_s']:.0f} -> ratio {r['ratio']:.2f}; "
          f"engine peak in flight {r['engine_max_in_flight']}")
    per_call = r["cpu_ms_per_call"]
    total = r["cpu_ms_per_call_total"]
    print(f"worker peak RSS {r['peak_rss_mb']:.0f} MB ({r['worker_peak_rss_mib']:.0f} MiB); CPU ms per engine call: "
          + ", ".join(f"{name} {value:.2f}" for name, value in per_call.items())
          + f" (total {total:.2f} ms -> at most ~{1000 * r['cpu_cores'] / total:.0f} calls/s on {r['cpu_cores']} cores)")
    print(f"bounds from these CPU costs: {r['cpu_cores']} cores shared by all processes >= "
          f"{r['cpu_bound_seconds']:.2f}s; one worker process sending a turn of {r['concurrency']} rollouts "
          f"({per_call['worker']:.2f} ms each) + {r['turns']} x {r['latency_s']:g}s latency >= "
          f"{r['worker_bound_seconds']:.2f}s -> best possible ratio {r['bound_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
