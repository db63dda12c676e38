"""Ingest: `/buffer/write` records/s with realistic records and 64 concurrent clients, against a no-op
endpoint on the same server stack that only parses the same body; and the batched writes
(`/buffer/write_packed`, records in the store's packed form; `/buffer/write_batch`, JSON) against single
writes. All measured in one run against one real server on the embedded Redis (AOF on)."""

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

from bench.records import realistic_record
from rollout_buffer.packed_batch import CONTENT_TYPE, encode_batch

CLIENTS = 64


def _bodies(count: int, run_id: str, tag: str) -> list[bytes]:
    template = realistic_record("INSTANCE", "UID", seed=1)
    template["run_id"] = run_id
    raw = orjson.dumps(template)
    # distinct uids, groups of 8 per instance id, without re-serialising 60 KB per record
    return [raw.replace(b'"UID"', f'"{tag}-{i}"'.encode()).replace(b'"INSTANCE"', f'"{tag}-g{i // 8}"'.encode())
            for i in range(count)]


async def _drive(url: str, bodies: list[bytes], clients: int = CLIENTS, content_type: str = "application/json") -> float:
    """Posts every body with `clients` concurrent connections; returns bodies per second."""
    queue = list(reversed(bodies))
    headers = {"content-type": content_type}
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def client() -> None:
            while queue:
                body = queue.pop()
                async with session.post(url, data=body, headers=headers) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{url}: {response.status} {await response.text()}")
                    await response.read()

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return len(bodies) / (time.perf_counter() - started)


def _packed_batches(count: int, size: int, run_id: str) -> list[bytes]:
    """`/buffer/write_packed` bodies of the same records (packed before timing, as JSON bodies are)."""
    template = realistic_record("INSTANCE", "UID", seed=1)
    records = [{**template, "uid": f"packed-{i}", "instance_id": f"packed-g{i // 8}", "run_id": run_id}
               for i in range(count)]
    return [encode_batch(records[i:i + size]) for i in range(0, count, size)]


def _batches(bodies: list[bytes], size: int, run_id: str) -> list[bytes]:
    prefix = b'{"run_id":"' + run_id.encode() + b'","records":['
    return [prefix + b",".join(bodies[i:i + size]) + b"]}" for i in range(0, len(bodies), size)]


async def _run_async(base: str, input_file: Path, count: int, batch_size: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/start_rollout", json={
            "task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": 8,
            "run_id": f"bench-ingest-{int(time.time() * 1000)}"}) as response:
            run_id = (await response.json())["run_id"]
    await _drive(f"{base}/_bench/parse_only", _bodies(64, run_id, "warm"))  # warm-up, not timed
    noop = await _drive(f"{base}/_bench/parse_only", _bodies(count, run_id, "noop"))
    single = await _drive(f"{base}/buffer/write", _bodies(count, run_id, "single"))
    batch_clients = min(CLIENTS, max(count // batch_size, 1))
    json_batch_rate = await _drive(f"{base}/buffer/write_batch",
                                   _batches(_bodies(count, run_id, "jbatch"), batch_size, run_id), clients=batch_clients)
    packed_rate = await _drive(f"{base}/buffer/write_packed?run_id={run_id}",
                               _packed_batches(count, batch_size, run_id), clients=batch_clients,
                               content_type=CONTENT_TYPE)
    return {
        "records": count,
        "noop_records_per_s": noop,
        "write_records_per_s": single,
        "ratio": single / noop,
        "batch_size": batch_size,
        "batch_records_per_s": packed_rate * batch_size,
        "batch_ratio": packed_rate * batch_size / single,
        "json_batch_records_per_s": json_batch_rate * batch_size,
        "json_batch_ratio": json_batch_rate * batch_size / single,
    }


def run(quick: bool = False) -> dict[str, Any]:
    from tests.helpers import ServerProcess, write_jsonl

    count, batch_size = (768, 32) if quick else (3072, 64)
    tasks = Path(__file__).resolve().parent.parent / "tests" / "tasks"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "x"}])
        with ServerProcess(tmp_path / "data", "--task-dir", str(tasks), "--workers", "0",
                           env={"ROLLOUT_BUFFER_BENCH_ROUTES": "1"}) as server:
            return asyncio.run(_run_async(server.url, input_file, count, batch_size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args(argv).quick)
    print(f"ingest: write {r['write_records_per_s']:.0f} rec/s vs parse-only {r['noop_records_per_s']:.0f} rec/s "
          f"-> {r['ratio']:.2f}x (target >= 0.7)")
    print(f"batch ingest, packed ({r['batch_size']}/request): {r['batch_records_per_s']:.0f} rec/s vs single "
          f"{r['write_records_per_s']:.0f} rec/s -> {r['batch_ratio']:.2f}x (target >= 5); JSON batch "
          f"{r['json_batch_records_per_s']:.0f} rec/s -> {r['json_batch_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
