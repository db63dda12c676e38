"""Soak: a long-lived server's memory stays flat while runs come and go.

One real `rollout-buffer serve` (token set, in-process workers) is driven for `--minutes`: each cycle starts
a native run (`echo_line`, enqueued and rolled out by the workers), a slime-style legacy run (a
`run_rollout` thread writing through its capability URL) and an externally written run (`/buffer/write`,
`/buffer/write_batch`, `/buffer/write_packed`), reads every group with leased reads and acks, then deletes
the three runs. The server process's RSS is taken after a warm-up (`--warmup-s`, default 60 s, at least
`WARMUP_CYCLES` cycles: imports done, Redis connection pool and allocator arenas grown to the load's
size) and at the end; the soak fails when the end is more than `--max-growth` (default 10%)
above the start. The embedded redis-server's RSS is reported too (its data is deleted with the runs).

    python -m bench.soak [--minutes 5] [--warmup-s 60] [--max-growth 0.10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from rollout_buffer.wire.packed_batch import CONTENT_TYPE, encode_batch

REPO = Path(__file__).resolve().parent.parent
TOKEN = "soak-" + uuid.uuid4().hex
WARMUP_CYCLES = 3
LINES, REPEATS = 40, 2


def _record(run_id: str, instance: int, repeat: int, tag: str) -> dict[str, Any]:
    prompt = list(range(100, 400))
    return {"uid": f"{run_id}-{tag}-{instance}-{repeat}", "instance_id": f"x{instance}", "run_id": run_id,
            "messages": [{"role": "user", "content": f"q{instance}"}, {"role": "assistant", "content": "a" * 200}],
            "reward": float(repeat), "extra_info": {"tag": tag},
            "turns": [{"prompt_ids": prompt, "output_ids": list(range(500, 756)), "output_logprobs": [-0.5] * 256,
                       "finish_reason": "stop", "weight_version": "1"}]}


def _wait(client: httpx.Client, run_id: str, status: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get(f"/runs/{run_id}").json()["meta"].get("status") != status:
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id} not {status} within {timeout_s:g}s: {client.get(f'/runs/{run_id}').text}")
        time.sleep(0.05)


def _drain(client: httpx.Client, run_id: str, expected: int, timeout_s: float = 120.0) -> None:
    """Leased reads with acks until `expected` records came."""
    got, deadline, ack = 0, time.monotonic() + timeout_s, []
    while got < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id}: {got}/{expected} records within {timeout_s:g}s")
        answer = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 60, "wait_s": 1.0,
                                                        "ack": ack}).json()
        got += len(answer["data"]["data"])
        batch = answer["data"]["meta_info"].get("batch_id")
        ack = [batch] if answer["success"] and batch else []
    if ack:
        client.post("/ack", json={"run_id": run_id, "batch_ids": ack}).raise_for_status()


def cycle(client: httpx.Client, input_file: Path, number: int) -> int:
    """One cycle of starts, writes, reads and deletes; returns the records read."""
    tag = f"c{number}-{uuid.uuid4().hex[:6]}"
    native, legacy, external = f"soak-native-{tag}", f"soak-legacy-{tag}", f"soak-ext-{tag}"
    common = {"input_file": str(input_file), "num_repeat_per_sample": REPEATS, "num_epoch": 1, "num_process": 16}
    for body in ({"task_type": "echo_line", "run_id": native, "engine_api": "chat",
                  "remote_engine_url": "http://127.0.0.1:9", **common},
                 {"task_type": "slime_style", "run_id": legacy, **common},
                 {"task_type": "external", "run_id": external, "activate": False, **common}):
        client.post("/start_rollout", json=body).raise_for_status()
    third = LINES // 3
    for i in range(third):
        for r in range(REPEATS):
            client.post("/buffer/write", json=_record(external, i, r, "one")).raise_for_status()
    client.post("/buffer/write_batch", json={"run_id": external, "records": [
        _record(external, i, r, "batch") for i in range(third, 2 * third) for r in range(REPEATS)]}).raise_for_status()
    packed = encode_batch([_record(external, i, r, "packed") for i in range(2 * third, LINES) for r in range(REPEATS)])
    client.post(f"/buffer/write_packed?run_id={external}", content=packed,
                headers={"content-type": CONTENT_TYPE}).raise_for_status()
    expected = LINES * REPEATS
    for run_id in (native, legacy, external):
        _drain(client, run_id, expected)
    _wait(client, legacy, "finished")
    for run_id in (native, legacy, external):
        client.delete(f"/runs/{run_id}").raise_for_status()
    return 3 * expected


def _rss_mb(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


def run(minutes: float = 5.0, max_growth: float = 0.10, warmup_s: float = 60.0) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.support.helpers import ServerProcess, write_jsonl

    tasks = [str(REPO / "tests" / "fixtures" / d) for d in ("tasks", "legacy_tasks", "runtime_tasks")]
    flags = [x for d in tasks for x in ("--task-dir", d)]
    with tempfile.TemporaryDirectory(prefix="rb-soak-") as tmp:
        tmp_path = Path(tmp)
        input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": f"x{i}", "prompt": f"p{i}", "label": "1"}
                                                         for i in range(LINES)])
        with ServerProcess(tmp_path / "data", *flags, env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}) as server, \
                httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            assert server.proc is not None
            api = psutil.Process(server.proc.pid)
            redis_pid = int((tmp_path / "data" / "redis.pid").read_text())
            redis_server = psutil.Process(redis_pid)
            cycles = records = 0
            warm_until = time.monotonic() + warmup_s
            while cycles < WARMUP_CYCLES or time.monotonic() < warm_until:
                records += cycle(client, input_file, cycles)
                cycles += 1
            warmup_cycles = cycles
            start_rss, start_redis = _rss_mb(api), _rss_mb(redis_server)
            started = time.monotonic()
            while time.monotonic() - started < minutes * 60:
                records += cycle(client, input_file, cycles)
                cycles += 1
            end_rss, end_redis = _rss_mb(api), _rss_mb(redis_server)
            runs_left = client.get("/runs").json()["runs"]
    growth = end_rss / start_rss - 1
    return {"minutes": minutes, "warmup_s": warmup_s, "warmup_cycles": warmup_cycles, "cycles": cycles, "runs_started": 3 * cycles, "records_read": records,
            "rss_start_mb": start_rss, "rss_end_mb": end_rss, "rss_growth": growth,
            "redis_rss_start_mb": start_redis, "redis_rss_end_mb": end_redis, "runs_left": runs_left,
            "max_growth": max_growth, "ok": growth <= max_growth and not runs_left}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to drive the server (default 5)")
    parser.add_argument("--max-growth", type=float, default=0.10, help="largest RSS growth allowed (default 0.10)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="driving before the start RSS (default 60)")
    args = parser.parse_args(argv)
    r = run(args.minutes, args.max_growth, args.warmup_s)
    print(f"soak: {r['cycles']} cycles ({r['runs_started']} runs started and deleted, {r['records_read']} records "
          f"read); RSS measured over {r['minutes']:g} min after {r['warmup_cycles']} warm-up cycles "
          f"({r['warmup_s']:g} s)")
    print(f"server RSS {r['rss_start_mb']:.1f} MB -> {r['rss_end_mb']:.1f} MB ({r['rss_growth']:+.1%}, limit "
          f"{r['max_growth']:+.0%}); redis-server RSS {r['redis_rss_start_mb']:.1f} MB -> {r['redis_rss_end_mb']:.1f} MB; "
          f"runs left: {len(r['runs_left'])}")
    print("PASS" if r["ok"] else "FAIL")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
