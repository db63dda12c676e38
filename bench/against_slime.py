"""Against slime's own code, in the same run: `python -m bench --slime-dir DIR` (a checkout of slime's
repository; nothing of it is copied into this project, it is loaded from DIR at run time).

* message-path loss masks: slime's `MultiTurnLossMaskGenerator` (`slime/utils/mask_utils.py`, type
  "qwen") against our `build_samples` on records without `turns`, on the same distinct 4-turn tool-use
  conversations (`bench.sample_building.make_trajectories`, Qwen2.5 tokenizer); every conversation's ids
  must be identical or the run fails. Samples per CPU second of this process (the tokenizer's batch calls
  run in threads of this process, so their CPU is counted too); best of 3 rounds per side, the sides
  alternating, our block cache cold at the start of each round.
* single-record writes: slime's buffer server (`slime_plugins/rollout_buffer/buffer.py`, served by
  uvicorn as its `__main__` serves it, access log off) against our `/buffer/write` on a `rollout-buffer
  serve` process (embedded Redis, append-only file on), the same ~48 KB records, 64 clients each, both
  driven by the same load generator (`bench.load`: pre-encoded HTTP/1.1 requests on keep-alive connections).
* full JSON read: after the writes, one `/get_rollout_data` of everything on each side, both read by the
  same client, slime's own (aiohttp, `json={}` as the body, the answer parsed by `response.json()`, the
  standard `json` module, as `rollout_buffer_example.get_rollout_data` reads): what a slime user meets who
  points slime's reader at this buffer instead of slime's.
* the JSON read's bound: the same client reading our answer held pre-encoded in memory by a bare uvicorn app
  (`_serve_bound`): no buffer answers faster, so slime's read time over this one is the most any buffer's
  JSON read ratio can reach under slime's client.
* full read to records in the trainer's hands: the same records written to ours again (not timed), read
  with the adapter's packed read (decoded into numpy arrays), against slime's JSON read of the same trial.

Writes and reads alternate which side goes first (5 trials after a warm-up); each side's best trial counts
(the one least disturbed by other jobs on a shared machine), every trial is kept in the results.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

SLIME_GROUP = 16  # slime's buffer hands out groups of its default size (16)
CLIENTS = 64
MASK_ROUNDS = 3
# writes and reads: trials after a warm-up, sides alternating; best per side (other jobs on a shared machine
# hit a short trial of ours harder than slime's four times longer one, so a few more chances)
WRITE_TRIALS = 5


def _load(slime_dir: Path, relative: str, name: str) -> Any:
    """A module of slime's checkout, loaded from its file (no package import, no copy)."""
    path = slime_dir / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a slime checkout (pass --slime-dir)")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def masks(slime_dir: Path, quick: bool) -> dict[str, Any]:
    """Message-path loss masks against slime's real generator, tokens compared conversation by conversation."""
    from bench.sample_building import _rate, make_trajectories
    from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
    from slime_adapter.masks.loss_mask import cached_loss_mask_generator
    from slime_adapter.samples.build import build_samples

    mask_utils = _load(slime_dir, "slime/utils/mask_utils.py", "slime_mask_utils")
    n = 256 if quick else 1024
    tok = load_qwen_tokenizer("qwen2.5")
    getter = lambda: tok  # noqa: E731
    _, records = make_trajectories(n)
    slime = mask_utils.MultiTurnLossMaskGenerator(tok, tokenizer_type="qwen")
    warm = make_trajectories(2, seed=99)[1]
    build_samples(warm[0], getter, "qwen")
    slime.get_loss_mask(warm[1]["messages"], warm[1]["tools"])
    generator = cached_loss_mask_generator("qwen", tok)
    rates: dict[str, list[float]] = {"ours": [], "slime": []}
    for round_ in range(MASK_ROUNDS):  # sides alternate; each round starts our block cache cold
        for side in ("ours", "slime") if round_ % 2 == 0 else ("slime", "ours"):
            if side == "ours":
                generator.clear_block_cache()
                rate, samples = _rate(n, lambda: [build_samples(r, getter, "qwen")[0][0] for r in records])
            else:
                rate, reference = _rate(n, lambda: [slime.get_loss_mask(r["messages"], r["tools"]) for r in records])
            rates[side].append(rate)
        for sample, (ids, _mask) in zip(samples, reference):
            if sample.tokens != ids:
                raise AssertionError(f"our tokens differ from slime's generator for {sample.metadata['uid']}")
    ours_rate, slime_rate = max(rates["ours"]), max(rates["slime"])  # best of the rounds: the least disturbed
    return {"samples": n, "rounds": rates, "ours_per_s": ours_rate, "slime_per_s": slime_rate,
            "ratio": ours_rate / slime_rate, "identical_tokens": True}


def _serve_bound(port: int) -> None:
    """The fastest answer an HTTP server of this stack can give: `/get_rollout_data` answers the bytes last
    posted to `/load`, encoded beforehand and held in memory (uvicorn, as both buffers are served). No buffer
    answers faster; its read is the JSON read's bound under slime's client."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    held = [b"{}"]

    async def load(request: Request) -> Response:
        held[0] = await request.body()
        return Response(b"{}", media_type="application/json")

    async def answer(request: Request) -> Response:
        return Response(held[0], media_type="application/json")

    app = Starlette(routes=[Route("/load", load, methods=["POST"]), Route("/get_rollout_data", answer, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, timeout_keep_alive=5, log_level="warning")


def _serve_slime(slime_dir: Path, port: int) -> None:
    """slime's buffer app, served as its `__main__` serves it (on loopback, access log off)."""
    import uvicorn

    buffer = _load(slime_dir, "slime_plugins/rollout_buffer/buffer.py", "slime_rollout_buffer")
    uvicorn.run(buffer.app, host="127.0.0.1", port=port, limit_concurrency=1000, timeout_keep_alive=5,
                log_level="warning")


async def _read_json(url: str) -> tuple[list[dict[str, Any]], float]:
    """slime's own client read (`rollout_buffer_example.get_rollout_data`): aiohttp, `{}`, the body parsed
    by `response.json()` (the standard `json` module). Ours answers `{}` from the run last started. Also
    returns the seconds to the whole body (server work and transfer): `response.json()` reads the body
    first, which is awaited apart here to split the time; the work is the same."""
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        async with session.post(f"{url}/get_rollout_data", json={},
                                timeout=aiohttp.ClientTimeout(total=600)) as response:
            await response.read()
            received = time.perf_counter() - started
            answer = await response.json()
    return answer["data"]["data"], received


def _bodies(count: int, run_id: str | None, tag: str, seed: int) -> list[bytes]:
    from bench.read_throughput import as_lists, make_record

    out = []
    for i in range(count):
        record = as_lists(make_record(i, seed=seed))
        record.update(uid=f"{tag}-{i}", instance_id=f"{tag}-g{i // SLIME_GROUP}")
        if run_id is not None:
            record["run_id"] = run_id
        out.append(orjson.dumps(record))
    return out


SIDES = ("slime", "ours", "ours_one")  # slime's buffer.py; `rollout-buffer serve` at its defaults; with one API process


def buffer_rows(slime_dir: Path, quick: bool) -> dict[str, Any]:
    """Writes, then one full JSON read, on every side; then our packed read of the same records written
    again; `trials` rounds, the sides taking turns to go first."""
    from bench.load import drive
    from bench.procs import cpu_roles, cpu_seconds_precise
    from bench.read_throughput import TASKS, _timed_read, _wait_healthy
    from rollout_buffer.settings import default_api_processes
    from tests.support.helpers import ServerProcess, free_port, write_jsonl

    count, trials = (512, 2) if quick else (2048, WRITE_TRIALS)
    writes: dict[str, list[float]] = {side: [] for side in SIDES}
    reads: dict[str, list[float]] = {side: [] for side in SIDES}  # the full JSON read, slime's client on all
    read_body: dict[str, list[float]] = {side: [] for side in SIDES}  # its seconds to the whole body
    bound_reads: list[float] = []  # the same client reading our answer served pre-encoded (`_serve_bound`)
    packed: list[float] = []  # our packed read of the same records, decoded into arrays
    ours_body: list[float] = []  # our packed read's seconds to the whole body (server work and transfer)
    cpu: dict[str, list[tuple[float, float, float]]] = {side: [] for side in SIDES}  # ms per record written
    read_cpu: dict[str, list[tuple[float, float, float]]] = {side: [] for side in SIDES}  # ms per record read
    record_bytes, api_processes = 0, default_api_processes()
    with tempfile.TemporaryDirectory(prefix="rb-bench-slime-") as tmp:
        work = Path(tmp)
        input_file = write_jsonl(work / "in.jsonl", [{"instance_id": "x"}])
        port, bound_port = free_port(), free_port()
        bound = subprocess.Popen([sys.executable, "-m", "bench.against_slime", "--serve-bound", str(bound_port),
                                  "--slime-dir", str(slime_dir)], cwd=Path(__file__).resolve().parent.parent,
                                 stdout=subprocess.DEVNULL)
        slime = subprocess.Popen([sys.executable, "-m", "bench.against_slime", "--serve-slime", str(port),
                                  "--slime-dir", str(slime_dir)], cwd=Path(__file__).resolve().parent.parent,
                                 stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "0"})
        loop = asyncio.new_event_loop()
        try:
            slime_url, bound_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{bound_port}"
            _wait_healthy(slime_url, slime)
            _wait_healthy(bound_url, bound)
            serve = ("--task-dir", str(TASKS), "--workers", "0")
            with ServerProcess(work / "data", *serve, env={"ROLLOUT_BUFFER_API_PROCESSES": str(api_processes)}
                               ) as server, ServerProcess(work / "data-one", *serve) as one:
                urls = {"slime": slime_url, "ours": server.url, "ours_one": one.url}
                pids = {"slime": slime.pid, "ours": server.proc.pid, "ours_one": one.proc.pid}
                for trial in range(trials + 1):  # trial 0 warms every side up and is not counted
                    bodies = {"slime": _bodies(count, None, f"s{trial}", trial)}
                    for side in SIDES[1:]:
                        run_id = loop.run_until_complete(_start(urls[side], input_file, f"{side}{trial}"))
                        bodies[side] = _bodies(count, run_id, f"o{trial}", trial)
                    record_bytes = len(bodies["ours"][0])
                    order = list(SIDES[trial % 3:] + SIDES[:trial % 3])
                    for side in order:
                        before, own = cpu_roles(pids[side]), cpu_seconds_precise(os.getpid())
                        seconds = loop.run_until_complete(drive(f"{urls[side]}/buffer/write", bodies[side],
                                                                clients=CLIENTS))
                        own = cpu_seconds_precise(os.getpid()) - own  # before the /proc scans of cpu_roles
                        if trial:
                            writes[side].append(seconds)
                            cpu[side].append(_per_record(before, cpu_roles(pids[side]), own, count))
                    del bodies
                    for side in order:
                        before, own = cpu_roles(pids[side]), cpu_seconds_precise(os.getpid())
                        started = time.perf_counter()
                        got, received = loop.run_until_complete(_read_json(urls[side]))
                        elapsed = time.perf_counter() - started
                        own = cpu_seconds_precise(os.getpid()) - own
                        if len(got) != count:
                            raise AssertionError(f"{side} read {len(got)} of {count} records")
                        if trial:
                            reads[side].append(elapsed)
                            read_body[side].append(received)
                            read_cpu[side].append(_per_record(before, cpu_roles(pids[side]), own, count))
                        if side == "ours":  # the bound's answer: our records, encoded before the read
                            httpx.post(f"{bound_url}/load", timeout=600, content=orjson.dumps(
                                {"success": True, "message": "", "data": {"data": got, "meta_info": {}}}))
                        del got
                    started = time.perf_counter()
                    got, received = loop.run_until_complete(_read_json(bound_url))
                    if trial:
                        bound_reads.append(time.perf_counter() - started)
                    del got
                    run_id = loop.run_until_complete(_start(server.url, input_file, f"packed{trial}"))
                    _fill_packed(server.url, run_id, _bodies(count, None, f"p{trial}", trial))
                    body_s, elapsed, got = _timed_read(loop, server.url, "packed", run_id, count)
                    if trial:
                        packed.append(elapsed)
                        ours_body.append(body_s)
                    del got
        finally:
            loop.close()
            for proc in (slime, bound):
                proc.terminate()
                proc.wait(timeout=30)
    # best of the trials per side (the least disturbed by other jobs on the machine); every trial is kept
    write_rate = {side: count / min(v) for side, v in writes.items()}
    read_rate = {side: count / min(v) for side, v in reads.items()}
    packed_rate = count / min(packed)
    client = {side: min(t - b for t, b in zip(reads[side], read_body[side])) for side in SIDES}
    return {"records": count, "record_json_bytes": record_bytes, "clients": CLIENTS, "api_processes": api_processes,
            "write_s": writes, "read_s": reads, "read_body_s": read_body, "packed_read_s": packed,
            "ours_read_body_s": ours_body, "write_per_s": write_rate, "read_per_s": read_rate,
            "packed_per_s": packed_rate,
            "write_ratio": write_rate["ours"] / write_rate["slime"],
            # per side, the median trial's CPU ms per record: the server's processes but Redis, Redis (and its
            # AOF-rewrite children), this process (the load generator, or the reading client)
            "write_cpu_ms_per_record": {side: dict(zip(("server", "redis", "client"), median(v)))
                                        for side, v in cpu.items()},
            "read_cpu_ms_per_record": {side: dict(zip(("server", "redis", "client"), median(v)))
                                       for side, v in read_cpu.items()},
            # the client's part of the JSON read (decode and stdlib parse, the same client on every side): were
            # our body to arrive in no time at all, our read could be at most this much faster than slime's
            "json_read_ceiling": min(reads["slime"]) / client["ours"],
            # the same client reading our answer held pre-encoded in memory by a bare uvicorn app: no buffer answers
            # faster, so slime's read time over this one is the most any buffer's JSON read ratio can be
            "json_read_bound_s": bound_reads,
            "json_read_bound_ratio": min(reads["slime"]) / min(bound_reads),
            "json_read_client_s": client,
            "json_read_ratio": read_rate["ours"] / read_rate["slime"],
            "read_ratio": packed_rate / read_rate["slime"]}


def median(values: list[Any]) -> Any:
    return sorted(values)[len(values) // 2]


def _per_record(before: tuple[float, float], after: tuple[float, float], own: float, count: int
                ) -> tuple[float, float, float]:
    """ms per record: the server's processes but Redis, Redis, this process (`own` CPU seconds)."""
    return 1000 * (after[0] - before[0]) / count, 1000 * (after[1] - before[1]) / count, 1000 * own / count


def _fill_packed(url: str, run_id: str, bodies: list[bytes]) -> None:
    """The records stored again in `run_id` through `/buffer/write_packed` (not timed): the packed read's input."""
    from rollout_buffer.wire.packed_batch import CONTENT_TYPE, encode_batch

    with httpx.Client(base_url=url, timeout=600) as client:
        for start in range(0, len(bodies), 256):
            body = encode_batch([orjson.loads(b) for b in bodies[start:start + 256]])
            response = client.post(f"/buffer/write_packed?run_id={run_id}", content=body,
                                   headers={"content-type": CONTENT_TYPE})
            if response.status_code != 200:
                raise AssertionError(f"packed fill: {response.status_code} {response.text[:300]}")


async def _start(url: str, input_file: Path, tag: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/start_rollout", json={
                "task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": SLIME_GROUP,
                "run_id": f"bench-{tag}-{int(time.time() * 1000)}"}) as response:
            return (await response.json())["run_id"]


def run(quick: bool = False, slime_dir: Path | None = None) -> dict[str, Any]:
    """Every row against slime, or `{"skipped": ...}` without a checkout."""
    if slime_dir is None:
        return {"skipped": "no --slime-dir"}
    slime_dir = Path(slime_dir)
    return {"slime_dir_commit": _commit(slime_dir), "load_average": os.getloadavg(),
            "masks": masks(slime_dir, quick), "buffer": buffer_rows(slime_dir, quick)}


def _commit(slime_dir: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(slime_dir), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--slime-dir", type=Path, required=True)
    parser.add_argument("--serve-slime", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-bound", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bound:
        _serve_bound(args.serve_bound)
        return 0
    if args.serve_slime:
        _serve_slime(args.slime_dir, args.serve_slime)
        return 0
    print(json.dumps(run(args.quick, args.slime_dir), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
