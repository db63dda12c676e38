"""Where a gateway turn's CPU goes: 128 sessions x 8 turns (a growing history, as bench/scale.py sends)
against one `serve` API process and the test engine, the server sampled by py-spy, and its samples sorted
into parts and into the package functions that hold the most of them.

    py-spy record --subprocesses --format raw -r 200 -o gateway.txt -- python -m bench.gateway_profile
    python -m bench.gateway_profile --fold gateway.txt

Only gateway turns run while the clock runs, so every busy server sample belongs to them; the driver's and
the engine's samples are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine call (aiohttp client, answer parse)", ("runtime/sglang_client.py", "runtime/engine_http.py")),
    ("rendering and tokenizing the new messages", ("api/gateway/rendering.py", "tokenizers/")),
    ("history: matching the client's messages to the session", ("api/gateway/history.py",)),
    ("session state in Redis (scripts, round trips)", ("store/session", "store/sessions.py", "redis/")),
    ("the answer (OpenAI shape, tool-call parsing)", ("api/gateway/wire_", "api/gateway/parsers.py")),
    ("request body parse and checks", ("api/gateway/json_limits.py", "api/gateway/schemas.py", "pydantic/",
                                       "api/bodies.py")),
    ("HTTP stack (uvicorn, starlette, fastapi routing, middleware)", ("uvicorn/", "starlette/", "fastapi/",
                                                                     "httptools", "rollout_buffer/api/")),
    ("event loop in C and the rest", ("",)),
)
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)")


def fold(path: Path, top: int = 25) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Share per part, and the package functions with the largest inclusive share, of the server's samples."""
    parts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2 or "rollout_buffer.cli serve" not in frames[1]:
            continue  # the driver, the engine
        body = ";".join(frames[2:])
        if "_find_and_load" in body or "lifespan" in body or "load_tokenizer" in body or (
                "concurrent/futures/thread.py" in body and "_WorkItem.run" not in body):
            continue  # start-up, the run's tokenizer loading (once per process), idle pool threads
        body = body.rpartition("Runner.run (")[2]
        part = next(name for name, markers in PARTS if any(m in body for m in markers))
        parts[part] += int(count)
        seen = set()
        for frame in body.split(";"):
            match = FRAME.match(frame.strip())
            if match and "rollout_buffer/" in match["file"]:
                name = f"{match['func']} ({match['file'].split('rollout_buffer/', 1)[1]})"
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += int(count)
    total = sum(parts.values()) or 1
    return ({name: parts[name] / total for name, _ in PARTS},
            [(name, n / total) for name, n in inclusive.most_common(top)])


def run(sessions: int, turns: int) -> None:
    from bench.rollout_concurrency import _free_port, _spawn, _stop, _wait_for
    from bench.scale import _sessions_run
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
    import httpx

    tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine_port, port = _free_port(), _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--seed", "1", "--latency-s", "0.5"],
                        work / "engine.log")
        server = _spawn(["serve", "--port", str(port), "--data-dir", str(work / "data"), "--workers", "0",
                         "--api-processes", "1", "--log-level", "warning", "--input-root", tokenizer],
                        work / "server.log")
        url, engine_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
        try:
            _wait_for(f"{engine_url}/health", engine)
            _wait_for(f"{url}/health", server)
            with httpx.Client(base_url=url, timeout=60) as client:
                client.post("/start_rollout", json={
                    "task_type": "external", "remote_engine_url": engine_url, "tokenizer_path": tokenizer,
                    "run_id": "profile-gateway", "num_repeat_per_sample": 1,
                    "sampling_params": {"max_tokens": 32}}).raise_for_status()
                made = [client.post("/runs/profile-gateway/sessions", json={"instance_id": f"s{i}"}).json()
                        for i in range(sessions)]
            times, errors = asyncio.run(_sessions_run(url, made, turns, 200))
            print(f"{len(times)} turns, {errors} errors", file=sys.stderr)
        finally:
            _stop(server)
            _stop(engine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fold", type=Path, help="sort a py-spy raw profile of this driver into parts")
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args(argv)
    if args.fold:
        parts, functions = fold(args.fold)
        for name, share in parts.items():
            print(f"{share * 100:5.1f}%  {name}")
        print("package functions, inclusive:")
        for name, share in functions:
            print(f"{share * 100:5.1f}%  {name}")
        return 0
    run(args.sessions, args.turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
