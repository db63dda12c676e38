"""A thousand agents on the gateway: 1,024 sessions at once, the engine taking 4 s a call, 4 turns each with a
growing history (every turn adds a ~200-word user message and the answer), so ~250 turns/s arrive: the
agents start over one engine latency (not in the same millisecond), each with its own client and connection.

Ours: `serve --api-processes N --workers 0` (N = 1, then 2; embedded Redis) in front of the test engine
(`rollout-buffer test-engine`, its own process); the load generator (plain aiohttp, the whole history sent
each call, as agents do) runs here and times every call, its heap kept out of its garbage collections. Baseline, in the same run right after: a bare
aiohttp client replaying exactly the `/generate` calls the engine logged for those sessions (same ids, rids,
routing keys), at the same concurrency, timed call by call: the engine's own latency. A call's added latency
is the gateway's time for it minus the bare replay's time for the same call; the row prints p50 and p99 of
those, errors, the API processes' CPU per call, and the peak summed RSS of the API processes and Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson

from bench.bare_client import ROUTING_HEADER
from bench.gateway import WORDS
from bench.procs import RssSampler, cmdline, cpu_seconds_precise, tree
from bench.rollout_concurrency import _free_port, _spawn, _stop, _wait_for
from rollout_buffer.settings import usable_cores

Key = tuple[str, int]  # (session id, turn index)


def _message(rng: random.Random, index: int, turn: int, words: int) -> str:
    return (f"Agent {index}, step {turn}: " + " ".join(rng.choice(WORDS) for _ in range(words))
            + f". What is {index} + {turn}?")


async def _sessions_run(url: str, sessions: list[dict[str, Any]], turns: int, words: int,
                        spread_s: float = 0.0) -> tuple[dict[Key, float], int]:
    """Every session's turns, the sessions' first turns spread evenly over `spread_s`; (seconds per call, errors).
    Each session is its own client with its own keep-alive connection, as each agent is its own process."""
    times: dict[Key, float] = {}
    errors = 0
    timeout = aiohttp.ClientTimeout(total=600)

    async def one(index: int, session: dict[str, Any]) -> None:
        nonlocal errors
        rng = random.Random(index)
        await asyncio.sleep(spread_s * index / len(sessions))
        messages: list[dict[str, Any]] = []
        headers = {"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as http:
            for turn in range(turns):
                messages.append({"role": "user", "content": _message(rng, index, turn, words)})
                body = orjson.dumps({"model": "m", "messages": messages})
                started = time.perf_counter()
                try:
                    async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as reply:
                        answer = orjson.loads(await reply.read())
                        status = reply.status
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    errors += 1
                    return
                if status != 200:
                    errors += 1
                    return
                times[(session["session_id"], turn)] = time.perf_counter() - started
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})

    await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    return times, errors


async def _replay_timed(url: str, calls: list[dict[str, Any]], params: dict[str, Any],
                        starts: dict[str, float]) -> dict[Key, float]:
    """The engine's logged calls replayed by a bare client, each session's in order, each session starting at
    the offset (seconds) it started at in the gateway's run."""
    per_session: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        rid = str(call["rid"])
        per_session.setdefault(rid.split(":", 1)[0], []).append(
            {"input_ids": call["prompt_ids"], "return_logprob": True, "sampling_params": dict(params), "rid": rid})
    times: dict[Key, float] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(session_id: str, bodies: list[dict[str, Any]]) -> None:
            await asyncio.sleep(starts.get(session_id, 0.0))
            for turn, body in enumerate(bodies):
                started = time.perf_counter()
                async with http.post(f"{url}/generate", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json", ROUTING_HEADER: session_id}) as r:
                    answer = orjson.loads(await r.read())
                if r.status != 200 or "meta_info" not in answer:
                    raise RuntimeError(f"baseline call failed: HTTP {r.status}: {answer}")
                times[(session_id, turn)] = time.perf_counter() - started

        await asyncio.gather(*(one(sid, bodies) for sid, bodies in per_session.items()))
    return times


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The load generator's heap (the sessions' histories, the replayed calls: millions of references) kept
    out of its garbage collections while it times calls, so a collection's pause is not counted as latency."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _one_config(work: Path, engine: Any, engine_url: str, tokenizer: str, api_processes: int, sessions_n: int,
                turns: int, words: int, spread_s: float) -> dict[str, Any]:
    from rollout_buffer.runtime.options import sglang_sampling_params
    from rollout_buffer.runtime.worker_main import event_loop_factory
    from rollout_buffer.wire.schema import StartRolloutRequest

    port = _free_port()
    server = _spawn(["serve", "--port", str(port), "--data-dir", str(work / f"data{api_processes}"), "--workers", "0",
                     "--api-processes", str(api_processes), "--log-level", "warning", "--input-root", tokenizer,
                     "--max-connections", "4096"], work / f"server{api_processes}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{url}/health", server, timeout_s=120)
        sampling = {"max_tokens": 32}
        with httpx.Client(base_url=url, timeout=120) as client:
            body = {"task_type": "external", "remote_engine_url": engine_url, "tokenizer_path": tokenizer,
                    "run_id": f"scale-{api_processes}", "num_repeat_per_sample": 1, "sampling_params": sampling,
                    "engine_timeout_s": 300}
            client.post("/start_rollout", json=body).raise_for_status()
            # every API process loads the run's tokenizer before the clock starts: its session sweep (every 5 s)
            # prepares each live run, and a few warm-up turns go through whichever processes accept them
            time.sleep(6)
            warm = [client.post(f"/runs/scale-{api_processes}/sessions", json={"instance_id": f"w{i}"}).json()
                    for i in range(4 * api_processes)]
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                runner.run(_sessions_run(url, warm, 1, 8))
            sessions = [client.post(f"/runs/scale-{api_processes}/sessions", json={"instance_id": f"s{i}"}).json()
                        for i in range(sessions_n)]
        httpx.post(f"{engine_url}/_test/reset_stats")
        procs = tree(server.pid)
        redis = [p for p in procs if "redis-server" in cmdline(p)]
        api = [p for p in procs if p not in redis]
        cpu_before = sum(map(cpu_seconds_precise, api))
        with RssSampler(procs, every_s=0.2) as rss, asyncio.Runner(loop_factory=event_loop_factory()) as runner, \
                _frozen_heap():
            started = time.perf_counter()
            times, errors = runner.run(_sessions_run(url, sessions, turns, words, spread_s))
            seconds = time.perf_counter() - started
        cpu_ms = 1000 * (sum(map(cpu_seconds_precise, api)) - cpu_before) / max(1, len(times))
        calls = httpx.get(f"{engine_url}/_test/calls").json()
        if len(calls) != len(times):
            raise RuntimeError(f"the engine logged {len(calls)} calls for {len(times)} answered turns")
        httpx.post(f"{engine_url}/_test/reset_stats")
        params = sglang_sampling_params(StartRolloutRequest(task_type="external", sampling_params=sampling))
        starts = {s["session_id"]: spread_s * i / len(sessions) for i, s in enumerate(sessions)}
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner, _frozen_heap():
            bare = runner.run(_replay_timed(engine_url, calls, params, starts))
    finally:
        _stop(server)
    added = np.array([1000 * (times[k] - bare[k]) for k in times if k in bare])
    by_turn = {t: [1000 * (times[k] - bare[k]) for k in times if k in bare and k[1] == t] for t in range(turns)}
    engine_ms = np.array([1000 * v for v in bare.values()])
    return {"api_processes": api_processes, "calls": len(times), "errors": errors, "seconds": seconds,
            "turns_per_s": len(times) / seconds, "added_p50_ms": float(np.percentile(added, 50)),
            "added_p99_ms": float(np.percentile(added, 99)),
            "added_p99_ms_by_turn": [float(np.percentile(v, 99)) for v in by_turn.values() if v],
            "engine_p50_ms": float(np.percentile(engine_ms, 50)),
            "engine_p99_ms": float(np.percentile(engine_ms, 99)), "api_cpu_ms_per_call": cpu_ms,
            "peak_rss_mb": rss.peak_kib / 1024,
            "peak_redis_mb": sum(v for p, v in rss.peak_by_pid.items() if p in redis) / 1024,
            "last_prompt_tokens": max((len(c["prompt_ids"]) for c in calls), default=0)}


def run(quick: bool = False, *, sessions: int | None = None, turns: int = 4, words: int = 200,
        latency_s: float = 4.0, processes: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    sessions = sessions or (256 if quick else 1024)
    tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="rb-bench-scale-") as tmp:
        work = Path(tmp)
        engine_port = _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--seed", "1"], work / "engine.log")
        engine_url = f"http://127.0.0.1:{engine_port}"
        try:
            _wait_for(f"{engine_url}/health", engine)
            # the engine logs every call of the run (its default keeps the last 2,048): the baseline replays them all
            httpx.post(f"{engine_url}/_test/config",
                       json={"latency_s": latency_s, "call_log_size": 2 * sessions * turns}).raise_for_status()
            for n in processes:
                # agents do not start in the same millisecond: their first turns spread over one engine
                # latency, so the ~250 turns/s arrive steadily rather than as 1,024-call bursts every 4 s
                results.append(_one_config(work, engine, engine_url, tokenizer, n, sessions, turns, words,
                                           spread_s=latency_s))
        finally:
            _stop(engine)
    return {"sessions": sessions, "turns": turns, "words_per_turn": words, "latency_s": latency_s,
            "configs": results, "cores": usable_cores(),
            "load_average": {"before": load_before[0], "after": os.getloadavg()[0]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sessions", type=int)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    r = run(args.quick, sessions=args.sessions, processes=tuple(args.processes))
    for c in r["configs"]:
        print(f"{r['sessions']} sessions x {r['turns']} turns, {c['api_processes']} API proc.: added p50 "
              f"{c['added_p50_ms']:.0f} ms, p99 {c['added_p99_ms']:.0f} ms (engine p50 {c['engine_p50_ms']:.0f} ms), "
              f"{c['errors']} errors, {c['turns_per_s']:.0f} turns/s, API CPU {c['api_cpu_ms_per_call']:.2f} ms/call, "
              f"peak RSS API+Redis {c['peak_rss_mb']:.0f} MB (Redis {c['peak_redis_mb']:.0f} MB); p99 by turn "
              + ", ".join(f"{v:.0f}" for v in c["added_p99_ms_by_turn"]) + " ms")
    print(f"load average {r['load_average']['before']:.1f} -> {r['load_average']['after']:.1f} on {r['cores']} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
