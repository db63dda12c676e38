"""The agent gateway: CPU per turn as a session grows, and calls/s at 256 concurrent sessions.

CPU per turn: `sessions` OpenAI-style clients (plain aiohttp, the whole history re-sent each call, as
agents do) each hold one session of 64 turns; every turn adds a ~500-token user message, so turn 64's
prompt is ~34k tokens. Turns go in lockstep (turn k of every session at once) and the API process's CPU
time (/proc) over each step, divided by the sessions, is that turn's cost. The target: turn 64 costs
less than 2x turn 1 (the gateway renders and tokenizes only what the client added).

Concurrency: 256 sessions x 3 turns at once against the test engine at a fixed latency, through the
gateway; baseline, in the same run, a bare aiohttp client replaying exactly the `/generate` calls the
engine logged for them (same ids, rids, routing keys, sampling params), at the same concurrency. Target
>= 0.85x. The engine and the server run as their own processes (`rollout-buffer test-engine`, `serve`
with no rollout workers); the load generator runs here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from bench.bare_client import run_baseline
from bench.procs import cpu_seconds_precise
from bench.rollout_concurrency import _free_port, _spawn, _stop, _wait_for

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor")


def _note(rng: random.Random, turn: int, words: int) -> str:
    return f"Note {turn}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ". What is 2 + 3?"


async def _chat(session: aiohttp.ClientSession, url: str, key: str, messages: list[dict[str, Any]],
                usage: list[int] | None = None) -> dict[str, Any]:
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps({"model": "m", "messages": messages}),
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as reply:
        body = orjson.loads(await reply.read())
    if reply.status != 200:
        raise RuntimeError(f"gateway answered {reply.status}: {body}")
    if usage is not None:
        usage.append(body["usage"]["prompt_tokens"])
    return body["choices"][0]["message"]


def _sessions(client: httpx.Client, run_id: str, count: int) -> list[dict[str, Any]]:
    return [client.post(f"/runs/{run_id}/sessions", json={"instance_id": f"s{i}"}).json() for i in range(count)]


def _start(client: httpx.Client, engine_url: str, tokenizer: str, run_id: str) -> str:
    body = {"task_type": "external", "remote_engine_url": engine_url, "tokenizer_path": tokenizer, "run_id": run_id,
            "num_repeat_per_sample": 1, "sampling_params": {"max_tokens": 64}, "engine_timeout_s": 120}
    answer = client.post("/start_rollout", json=body)
    answer.raise_for_status()
    return answer.json()["run_id"]


async def _cpu_steps(url: str, sessions: list[dict[str, Any]], turns: int, words: int,
                     server_pid: int) -> list[dict[str, float]]:
    rng = random.Random(7)
    histories: list[list[dict[str, Any]]] = [[] for _ in sessions]
    steps = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for turn in range(1, turns + 1):
            for history in histories:
                history.append({"role": "user", "content": _note(rng, turn, words)})
            before, started = cpu_seconds_precise(server_pid), time.perf_counter()
            prompts: list[int] = []
            answers = await asyncio.gather(*(_chat(http, url, s["api_key"], h, prompts)
                                             for s, h in zip(sessions, histories)))
            used, wall = cpu_seconds_precise(server_pid) - before, time.perf_counter() - started
            for history, answer in zip(histories, answers):
                history.append({"role": "assistant", "content": answer["content"]})
            steps.append({"turn": turn, "cpu_ms_per_turn": 1000 * used / len(sessions), "wall_s": wall,
                          "prompt_tokens": max(prompts)})
    return steps


async def _concurrent(urls: list[str], sessions: list[dict[str, Any]], turns: int) -> tuple[float, int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        calls = 0

        async def one(index: int, key: str) -> None:
            nonlocal calls
            messages: list[dict[str, Any]] = []
            url = urls[index % len(urls)]  # sessions spread over the API processes, as a load balancer would
            for turn in range(turns):
                messages.append({"role": "user", "content": f"What is {index} + {turn * 3 + 1}?"})
                answer = await _chat(http, url, key, messages)
                messages.append({"role": "assistant", "content": answer["content"]})
                calls += 1

        started = time.perf_counter()
        await asyncio.gather(*(one(i, s["api_key"]) for i, s in enumerate(sessions)))
        return time.perf_counter() - started, calls


def _replay_bodies(calls: list[dict[str, Any]], params: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The engine's log of generations, as the bare client's `/generate` bodies, per session in order."""
    per_session: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        rid = str(call["rid"])
        session_id = rid.split(":", 1)[0]
        per_session.setdefault(session_id, []).append(
            {"input_ids": call["prompt_ids"], "return_logprob": True, "sampling_params": dict(params),
             "rid": rid, "_key": session_id})
    return list(per_session.values())


def run(quick: bool = False, *, cpu_sessions: int | None = None, turns: int = 64, words: int | None = None,
        concurrency: int = 256, latency_s: float | None = None, api_processes: int | None = None) -> dict[str, Any]:
    from rollout_buffer.runtime.options import sglang_sampling_params
    from rollout_buffer.runtime.worker_main import event_loop_factory
    from rollout_buffer.wire.schema import StartRolloutRequest
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    cpu_sessions = cpu_sessions or (8 if quick else 16)
    api_processes = api_processes or 1  # more share one Redis (as several hosts would); on 2 cores one is best
    words = words or 270  # ~500 tokens a turn: ~32k tokens by turn 64
    latency_s = latency_s if latency_s is not None else 0.5
    tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rb-bench-gw-") as tmp:
        work = Path(tmp)
        engine_port, server_port = _free_port(), _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--seed", "1"], work / "engine.log")
        flags = ["--workers", "0", "--log-level", "warning", "--input-root", tokenizer]
        server = _spawn(["serve", "--port", str(server_port), "--data-dir", str(work / "data"), *flags],
                        work / "server.log")
        more: list[Any] = []
        try:
            engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{server_port}"
            _wait_for(f"{engine_url}/health", engine)
            _wait_for(f"{url}/health", server)
            urls = [url]
            for k in range(1, api_processes):  # more API processes on the first one's Redis
                port = _free_port()
                more.append(_spawn(["serve", "--port", str(port), "--data-dir", str(work / f"data{k}"), *flags,
                                    "--redis-url", f"unix://{work / 'data' / 'redis.sock'}"], work / f"server{k}.log"))
                urls.append(f"http://127.0.0.1:{port}")
                _wait_for(f"{urls[-1]}/health", more[-1])
            with httpx.Client(base_url=url, timeout=120) as client:
                run_id = _start(client, engine_url, tokenizer, "gateway-cpu")
                warm = _sessions(client, run_id, 2)
                asyncio.run(_cpu_steps(url, warm, 2, 20, server.pid))  # tokenizer, template, connections
                sessions = _sessions(client, run_id, cpu_sessions)
                steps = asyncio.run(_cpu_steps(url, sessions, turns, words, server.pid))
                httpx.post(f"{engine_url}/_test/config", json={"latency_s": latency_s})
                httpx.post(f"{engine_url}/_test/reset_stats")
                run_id = _start(client, engine_url, tokenizer, "gateway-concurrency")
                warm = _sessions(client, run_id, len(urls))  # every API process loads the run's tokenizer first
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                    runner.run(_concurrent(urls, warm, 1))
                httpx.post(f"{engine_url}/_test/reset_stats")
                sessions = _sessions(client, run_id, concurrency)
                api_pids = [server.pid, *(p.pid for p in more)]
                cpu_before = (sum(map(cpu_seconds_precise, api_pids)), cpu_seconds_precise(engine.pid),
                              time.process_time())
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                    seconds, calls = runner.run(_concurrent(urls, sessions, 3))
                cpu_after = (sum(map(cpu_seconds_precise, api_pids)), cpu_seconds_precise(engine.pid),
                             time.process_time())
                cpu_ms = {name: 1000 * (after - before) / calls for name, before, after
                          in zip(("gateway", "engine", "load generator"), cpu_before, cpu_after)}
                logged = httpx.get(f"{engine_url}/_test/calls").json()
                tokens = httpx.get(f"{engine_url}/_test/stats").json()["generated_tokens"]
                httpx.post(f"{engine_url}/_test/reset_stats")
                params = sglang_sampling_params(StartRolloutRequest(task_type="external",
                                                                    sampling_params={"max_tokens": 64}))
                engine_before, bare_before = cpu_seconds_precise(engine.pid), time.process_time()
                base_seconds, base_calls = run_baseline(engine_url, _replay_bodies(logged, params), concurrency)
                cpu_ms["bare client"] = 1000 * (time.process_time() - bare_before) / calls
                cpu_ms["engine (bare)"] = 1000 * (cpu_seconds_precise(engine.pid) - engine_before) / calls
                base_tokens = httpx.get(f"{engine_url}/_test/stats").json()["generated_tokens"]
            if base_calls != calls or base_tokens != tokens:
                raise RuntimeError(f"the bare client did not replay the same work: {base_calls} calls, {base_tokens} "
                                   f"tokens vs {calls}, {tokens}")
        finally:
            for proc in (*more, server, engine):
                _stop(proc)
    first, last = steps[0]["cpu_ms_per_turn"], steps[-1]["cpu_ms_per_turn"]
    return {
        "cpu_sessions": cpu_sessions, "turns": turns, "words_per_turn": words,
        "last_prompt_tokens": steps[-1]["prompt_tokens"], "cpu_ms_turn_1": first, "cpu_ms_turn_last": last,
        "cpu_ratio": last / first if first else float("inf"), "steps": steps,
        "concurrency": concurrency, "latency_s": latency_s, "api_processes": api_processes, "calls": calls,
        "seconds": seconds,
        "calls_per_s": calls / seconds, "baseline_seconds": base_seconds, "baseline_calls_per_s": calls / base_seconds,
        "ratio": base_seconds / seconds, "ideal_calls_per_s": concurrency / latency_s, "cpu_ms_per_call": cpu_ms,
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    r = run(args.quick)
    print(f"CPU per turn: turn 1 {r['cpu_ms_turn_1']:.2f} ms, turn {r['turns']} {r['cpu_ms_turn_last']:.2f} ms "
          f"(ratio {r['cpu_ratio']:.2f}, target < 2)")
    print(f"{r['concurrency']} sessions: {r['calls_per_s']:.0f} calls/s, bare client {r['baseline_calls_per_s']:.0f} "
          f"(ratio {r['ratio']:.2f}, target >= 0.85; ideal {r['ideal_calls_per_s']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
