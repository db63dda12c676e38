"""Ingest: `/buffer/write` records/s with realistic records (~77 KB of JSON each) and 64 concurrent clients,
against two baselines on the same server stack: an endpoint that parses the same body and stores nothing
(`/_bench/parse_only`), and one that only reads the body (`/_bench/read_only`, the HTTP limit). Then the
batched writes, each against its like-for-like alternative: `/buffer/write_batch` (JSON) against single
JSON writes of the same records, and `/buffer/write_packed` against the JSON batch, with the client's
packing time counted in the packed rate. All measured in one run against one real server on the embedded
Redis (AOF on)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.load import CLIENTS, drive
from bench.procs import cpu_split
from bench.records import realistic_record
from rollout_buffer.wire.packed_batch import CONTENT_TYPE, encode_batch

ROUNDS = 3


def _bodies(count: int, run_id: str, tag: str) -> list[bytes]:
    template = realistic_record("INSTANCE", "UID", seed=1)
    template["run_id"] = run_id
    raw = orjson.dumps(template)
    # distinct uids, groups of 8 per instance id, without re-serialising 60 KB per record
    return [raw.replace(b'"UID"', f'"{tag}-{i}"'.encode()).replace(b'"INSTANCE"', f'"{tag}-g{i // 8}"'.encode())
            for i in range(count)]


def _packed_batches(count: int, size: int, run_id: str, tag: str = "packed") -> tuple[list[bytes], float]:
    """`/buffer/write_packed` bodies of the same records, and the seconds the client spent packing them
    (counted in the packed rate: a writer that has JSON-shaped records must pack them first)."""
    template = realistic_record("INSTANCE", "UID", seed=1)
    records = [{**template, "uid": f"{tag}-{i}", "instance_id": f"{tag}-g{i // 8}", "run_id": run_id}
               for i in range(count)]
    started = time.perf_counter()
    bodies = [encode_batch(records[i:i + size]) for i in range(0, count, size)]
    return bodies, time.perf_counter() - started


def _batches(bodies: list[bytes], size: int, run_id: str) -> list[bytes]:
    prefix = b'{"run_id":"' + run_id.encode() + b'","records":['
    return [prefix + b",".join(bodies[i:i + size]) + b"]}" for i in range(0, len(bodies), size)]


async def _run_async(base: str, input_file: Path, count: int, batch_size: int, rounds: int, server_pid: int
                     ) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/start_rollout", json={
            "task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": 8,
            "run_id": f"bench-ingest-{int(time.time() * 1000)}"}) as response:
            run_id = (await response.json())["run_id"]
    await drive(f"{base}/_bench/parse_only", _bodies(64, run_id, "warm"))  # warm-up, not timed
    batch_clients = min(CLIENTS, max(count // batch_size, 1))
    seconds: dict[str, list[float]] = {name: [] for name in ("read", "noop", "single", "jbatch", "packed")}
    cpu: dict[str, list[tuple[float, float, float]]] = {name: [] for name in seconds}  # ms per record

    async def measure(name: str, n: int) -> float:
        if name == "jbatch":
            batches = _batches(_bodies(count, run_id, f"jbatch{n}"), batch_size, run_id)
            return await drive(f"{base}/buffer/write_batch", batches, clients=batch_clients)
        if name == "packed":
            bodies, packing_s = _packed_batches(count, batch_size, run_id, f"packed{n}")
            packing.append(packing_s)
            return packing_s + await drive(f"{base}/buffer/write_packed?run_id={run_id}", bodies,
                                           clients=batch_clients, content_type=CONTENT_TYPE)
        return await drive(f"{base}/{routes[name]}", _bodies(count, run_id, f"{name}{n}"))

    routes = {"read": "_bench/read_only", "noop": "_bench/parse_only", "single": "buffer/write"}
    packing: list[float] = []
    for n in range(rounds):  # every side once per round, the order reversed every other round (Redis grows as
        for name in list(seconds) if n % 2 == 0 else list(seconds)[::-1]:  # the run goes: AOF rewrites)
            before = cpu_split(server_pid)
            seconds[name].append(await measure(name, n))
            cpu[name].append(tuple(1000 * (b - a) / count for a, b in zip(before, cpu_split(server_pid))))
    read_only, parse_only, single, json_batch, packed = (count / min(seconds[name]) for name in seconds)
    return {
        "records": count,
        "record_json_bytes": len(_bodies(1, run_id, "size")[0]),
        "read_only_records_per_s": read_only,
        "noop_records_per_s": parse_only,
        "write_records_per_s": single,
        "ratio": single / parse_only,
        "read_only_ratio": single / read_only,
        "batch_size": batch_size,
        "json_batch_records_per_s": json_batch,
        "json_batch_ratio": json_batch / single,
        "batch_records_per_s": packed,
        "packing_s": min(packing),
        "packed_vs_json_batch": packed / json_batch,
        "rounds_s": seconds,
        # per phase, the median round's CPU ms per record: the API process, Redis, the load generator
        "cpu_ms_per_record": {name: dict(zip(("api", "redis", "client"), sorted(rounds)[len(rounds) // 2]))
                              for name, rounds in cpu.items()},
    }


def run(quick: bool = False) -> dict[str, Any]:
    from tests.support.helpers import ServerProcess, write_jsonl

    count, batch_size = (768, 32) if quick else (3072, 64)
    tasks = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tasks"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "x"}])
        with ServerProcess(tmp_path / "data", "--task-dir", str(tasks), "--workers", "0",
                           module="bench.baseline_server") as server:
            return asyncio.run(_run_async(server.url, input_file, count, batch_size, 2 if quick else ROUNDS,
                                          server.proc.pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args(argv).quick)
    print(f"ingest ({r['record_json_bytes'] / 1024:.0f} KB records): write {r['write_records_per_s']:.0f} rec/s; "
          f"parse-only {r['noop_records_per_s']:.0f} rec/s -> {r['ratio']:.2f}x (target >= 0.8); read-only "
          f"{r['read_only_records_per_s']:.0f} rec/s -> {r['read_only_ratio']:.2f}x (target >= 0.35)")
    print(f"JSON batch ({r['batch_size']}/request): {r['json_batch_records_per_s']:.0f} rec/s -> "
          f"{r['json_batch_ratio']:.2f}x single JSON writes")
    print(f"packed batch, client packing included ({r['packing_s']:.2f} s): {r['batch_records_per_s']:.0f} rec/s "
          f"-> {r['packed_vs_json_batch']:.2f}x the JSON batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
