"""Read throughput: one full read of 4,096 records of ~48 KB each (as JSON), timed from the request to
the records in the client's hands, JSON and packed, against a minimal in-memory buffer in the same run.

Ours: a `rollout-buffer serve` process (embedded Redis) holding the records as ready groups of 8; the
client is the adapter's own read (the steps of `slime_adapter.reading.buffer_client.fetch_rollout_data`, leased as
the adapter reads), asking for JSON (parsed into lists) or for the packed form (decoded into numpy
arrays). The time to the whole body (server work and transfer) is reported apart from the client's.

Baseline: a FastAPI app on the same uvicorn stack (uvloop, httptools) in its own process, holding the same
records as a Python list of dicts in memory and answering `/get_rollout_data` with the standard `json`
module (`json.dumps` of the whole answer, no validation, no response model): what a minimal buffer does.
The client is the same JSON read as ours. Each trial writes the records into a fresh run of our buffer
(not timed) and then times one read of each kind; the kinds take turns, and the median over the trials
counts. Records are distinct (random token ids, float32-exact logprobs as engines send them), 4 turns
each, every prompt extending the previous turn as a multi-turn session's do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import Response

GROUP = 8
TURNS, FIRST_PROMPT, OUTPUT, TOOL, TEXT = 4, 100, 250, 40, 6000
WRITE_BATCH = 256
TASKS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tasks"


def make_record(index: int, *, seed: int = 0) -> dict[str, Any]:
    """Record `index` (deterministic for a seed): 4 turns with numpy arrays, ~48 KB as JSON."""
    rng = np.random.default_rng([seed, index])
    prompt = rng.integers(0, 151_000, FIRST_PROMPT, dtype=np.int64)
    turns = []
    for _ in range(TURNS):
        output = rng.integers(0, 151_000, OUTPUT, dtype=np.int64)
        logprobs = (-4 * rng.random(OUTPUT, dtype=np.float32)).astype(np.float64)
        turns.append({"prompt_ids": prompt, "output_ids": output, "output_logprobs": logprobs,
                      "finish_reason": "stop", "weight_version": "7"})
        prompt = np.concatenate([prompt, output, rng.integers(0, 151_000, TOOL, dtype=np.int64)])
    chunk = TEXT // (2 * TURNS + 1)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "q" * chunk}]
    for turn in range(TURNS):
        messages.append({"role": "assistant", "content": "a" * chunk})
        if turn < TURNS - 1:
            messages.append({"role": "tool", "content": "t" * chunk, "tool_call_id": f"call_{turn}"})
    return {"uid": f"u{index}", "instance_id": f"g{index // GROUP}", "messages": messages,
            "reward": float(rng.random()), "extra_info": {"source": "bench"}, "status": "completed", "turns": turns}


def as_lists(record: dict[str, Any]) -> dict[str, Any]:
    """The record as plain JSON values (what a JSON writer sends and a minimal buffer keeps)."""
    turns = [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in t.items()} for t in record["turns"]]
    return {**record, "turns": turns}


def baseline_app(count: int, seed: int) -> Any:
    """The baseline server: the records in a list, answered with `json.dumps`."""
    records = [as_lists(make_record(i, seed=seed)) for i in range(count)]
    app = FastAPI()

    @app.post("/get_rollout_data")
    async def get_rollout_data(request: Request) -> Response:
        await request.body()
        groups = sorted({r["instance_id"] for r in records})
        meta = {"total_samples": len(records), "num_groups": len(groups),
                "avg_reward": sum(r["reward"] for r in records) / len(records), "finished_groups": groups}
        body = {"success": True, "message": f"{len(records)} sample(s)", "data": {"data": records, "meta_info": meta}}
        return Response(json.dumps(body), media_type="application/json")

    return app


def _serve_baseline(port: int, count: int, seed: int) -> None:
    import uvicorn

    uvicorn.run(baseline_app(count, seed), host="127.0.0.1", port=port, log_level="warning")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the baseline server exited with {proc.returncode}")
        try:
            httpx.get(f"{url}/docs", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def _fill(client: httpx.Client, input_file: Path, records: list[bytes], tag: str) -> str:
    """A fresh run of our buffer holding every record as ready groups (not timed)."""
    from rollout_buffer.wire.packed_batch import CONTENT_TYPE

    run_id = client.post("/start_rollout", json={"task_type": "external", "input_file": str(input_file),
                                                 "num_repeat_per_sample": GROUP, "run_id": f"bench-read-{tag}"}
                         ).json()["run_id"]
    for start in range(0, len(records), WRITE_BATCH):
        body = b"".join(records[start:start + WRITE_BATCH])
        response = client.post(f"/buffer/write_packed?run_id={run_id}", content=body,
                               headers={"content-type": CONTENT_TYPE})
        assert response.status_code == 200, response.text
    return run_id


def _timed_read(loop: asyncio.AbstractEventLoop, url: str, read_format: str, run_id: str | None, count: int
                ) -> tuple[float, float, list[dict[str, Any]]]:
    """One leased read as the adapter makes it (`fetch_rollout_data`'s steps): (seconds to the whole body,
    seconds in all, records). The first part is the server's work and the transfer, the rest the client's
    decoding (JSON parse, or packed decode into arrays). It runs on a loop of its own, as the adapter's
    reads do: `asyncio.run` in the main thread would format the finished task, hundreds of MB of body
    included, when it puts the SIGINT handler back (CPython's `signal` module), and time that."""
    from rollout_buffer.wire import packed_read
    from slime_adapter.reading.buffer_client import _decode_answer, _parse_answer, _post

    payload: dict[str, Any] = {"wait_s": 0.0, "lease_s": 600.0}
    if run_id is not None:
        payload["run_id"] = run_id
    started = time.perf_counter()
    raw, content_type = loop.run_until_complete(_post(f"{url}/get_rollout_data", payload, 600.0,
                                                      accept=packed_read.accept_header(read_format == "packed")))
    received = time.perf_counter() - started
    records, _, message = _parse_answer(_decode_answer(raw, content_type))
    elapsed = time.perf_counter() - started
    assert len(records) == count, f"{read_format} read got {len(records)} of {count} records: {message}"
    return received, elapsed, records


def _check(records: list[dict[str, Any]], seed: int) -> None:
    """The read gave back what was written (one record checked in full)."""
    record = records[len(records) // 2]
    expected = make_record(int(record["uid"][1:]), seed=seed)
    for got, want in zip(record["turns"], expected["turns"]):
        for key in ("prompt_ids", "output_ids", "output_logprobs"):
            assert np.array_equal(np.asarray(got[key]), want[key]), key


def run(quick: bool = False) -> dict[str, Any]:
    from rollout_buffer.wire.packed_batch import encode_batch
    from rollout_buffer.wire.packing import pack_record
    from tests.support.helpers import ServerProcess, free_port, write_jsonl

    count, trials, seed = (1024, 3, 1) if quick else (4096, 3, 1)
    made = [make_record(i, seed=seed) for i in range(count)]
    json_bytes = sum(len(json.dumps(as_lists(r))) for r in made[:64]) / 64
    packed = [encode_batch([r]) for r in made]  # one length-prefixed record each, joined per write
    packed_bytes = sum(len(pack_record(r)) for r in made[:64]) / 64
    del made
    timings: dict[str, list[float]] = {"baseline": [], "json": [], "packed": []}
    received: dict[str, list[float]] = {"baseline": [], "json": [], "packed": []}
    with tempfile.TemporaryDirectory(prefix="rb-bench-read-") as tmp:
        work = Path(tmp)
        input_file = write_jsonl(work / "in.jsonl", [{"instance_id": "x"}])
        port = free_port()
        baseline = subprocess.Popen([sys.executable, "-m", "bench.read_throughput", "--serve-baseline", str(port),
                                     "--count", str(count), "--seed", str(seed)],
                                    cwd=Path(__file__).resolve().parent.parent)
        loop = asyncio.new_event_loop()
        try:
            baseline_url = f"http://127.0.0.1:{port}"
            _wait_healthy(baseline_url, baseline)
            with ServerProcess(work / "data", "--task-dir", str(TASKS), "--workers", "0") as server, \
                    httpx.Client(base_url=server.url, timeout=600) as client:
                kinds = ["baseline", "json", "packed"]
                for trial in range(trials + 1):  # trial 0 warms every path up and is not counted
                    for kind in kinds[trial % 3:] + kinds[:trial % 3]:
                        if kind == "baseline":
                            body_s, elapsed, records = _timed_read(loop, baseline_url, "json", None, count)
                        else:
                            run_id = _fill(client, input_file, packed, f"{kind}{trial}-{int(time.time() * 1000)}")
                            body_s, elapsed, records = _timed_read(loop, server.url, kind, run_id, count)
                            client.delete(f"/runs/{run_id}")
                        if trial == 0:
                            _check(records, seed)
                        else:
                            timings[kind].append(elapsed)
                            received[kind].append(body_s)
                        del records
        finally:
            loop.close()
            baseline.terminate()
            baseline.wait(timeout=30)
    medians = {kind: statistics.median(values) for kind, values in timings.items()}
    return {
        "records": count, "record_json_bytes": json_bytes, "record_packed_bytes": packed_bytes,
        "timings_s": timings, "median_s": medians,
        "body_median_s": {kind: statistics.median(values) for kind, values in received.items()},
        "records_per_s": {kind: count / value for kind, value in medians.items()},
        "json_ratio": medians["baseline"] / medians["json"],
        "packed_ratio": medians["baseline"] / medians["packed"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=4096, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline:
        _serve_baseline(args.serve_baseline, args.count, args.seed)
        return 0
    r = run(args.quick)
    m, b = r["median_s"], r["body_median_s"]
    print(f"full read of {r['records']} records ({r['record_json_bytes'] / 1024:.0f} KB JSON, "
          f"{r['record_packed_bytes'] / 1024:.0f} KB packed each): baseline {m['baseline']:.2f} s, "
          f"JSON {m['json']:.2f} s -> {r['json_ratio']:.2f}x (target >= 1.5), "
          f"packed {m['packed']:.2f} s -> {r['packed_ratio']:.2f}x (target >= 5)")
    for kind in ("baseline", "json", "packed"):
        print(f"  {kind:8}: server + transfer {b[kind]:.2f} s, client decoding {m[kind] - b[kind]:.2f} s (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
