"""The gateway's streamed answers: what streaming through the gateway adds to the first token, and what
it costs in turns/s.

First byte: 64 sessions of 6 streamed Chat Completions each against the test engine at a fixed prefill
latency and token rate; for each turn after a session's first, the time from the request to its first
streamed event. Baseline, in the same run, the same 64 loops of streamed `/generate` calls straight to the
engine, the time to their first chunk: the engine's time to first token. The gateway's overhead is the
difference, at p50 and at p99 (target p99 < 20 ms). The sessions start spread over one turn's engine time
(`SPREAD_S`, both sides alike), as a fleet of agents does: started in the same millisecond, every session's
turns stay in step with every other's and each turn arrives as one burst of 64 (measured too, printed as
`burst`). Three trials, each side measured in each; the trial with the lowest p99 added is the row's.

Throughput: the same sessions streamed and not streamed (target >= 0.9x, the best trial of each), with the
same engine time per turn: the test engine paces only streamed tokens (`token_delay_s`), so the unstreamed
run's engine latency is the streamed one's plus its mean tokens per call times the token delay (a real
engine takes as long to decode an answer it does not stream).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from bench.gateway import _sessions, _start
from bench.procs import cpu_seconds_precise
from bench.rollout_concurrency import _free_port, _spawn, _stop, _wait_for

LATENCY_S, TOKEN_DELAY_S = 0.2, 0.01
SPREAD_S = 0.4  # about one streamed turn's engine time: 0.2 s + ~21 tokens x 10 ms
TRIALS = 3


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def _first_content(http: aiohttp.ClientSession, url: str, key: str, messages: list[dict[str, Any]],
                         stream: bool) -> tuple[float, str]:
    """(seconds to the first streamed event, the answer's text); not streamed: to the whole answer."""
    started = time.perf_counter()
    first = 0.0
    text: list[str] = []
    body = {"model": "m", "messages": messages, "stream": stream}
    async with http.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"gateway answered {reply.status}: {await reply.text()}")
        if not stream:
            return time.perf_counter() - started, orjson.loads(await reply.read())["choices"][0]["message"]["content"]
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            first = first or time.perf_counter() - started
            choices = orjson.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta", {}).get("content")
            if delta:
                text.append(delta)
    return first, "".join(text)


async def _engine_first_chunks(engine_url: str, count: int, turns: int, prompt: list[int], spread_s: float
                               ) -> list[float]:
    """Each call's time to its first chunk, `count` loops of `turns` calls straight to the engine, after the
    first turn, the loops starting spread over `spread_s` (as the gateway's sessions do)."""
    firsts: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(i: int) -> None:
            await asyncio.sleep(spread_s * i / count)
            for turn in range(turns):
                body = {"input_ids": prompt, "return_logprob": True, "stream": True, "rid": f"bare-{i}-{turn}",
                        "sampling_params": {"max_new_tokens": 64}}
                started = time.perf_counter()
                first = 0.0
                async with http.post(f"{engine_url}/generate", data=orjson.dumps(body)) as reply:
                    async for line in reply.content:
                        if line.startswith(b"data: {") and not first:
                            first = time.perf_counter() - started
                if turn:
                    firsts.append(first)

        await asyncio.gather(*(one(i) for i in range(count)))
    return firsts


async def _turns(url: str, sessions: list[dict[str, Any]], turns: int, stream: bool, spread_s: float = 0.0
                 ) -> tuple[float, list[float]]:
    """(seconds for every session's `turns` turns, each call's seconds to its first event after the first turn);
    the sessions' first turns spread over `spread_s`."""
    firsts: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(index: int, key: str) -> None:
            await asyncio.sleep(spread_s * index / len(sessions))
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"What is {index} + {turn * 3 + 1}?"})
                first, text = await _first_content(http, url, key, messages, stream)
                if turn:
                    firsts.append(first)
                messages.append({"role": "assistant", "content": text})

        started = time.perf_counter()
        await asyncio.gather(*(one(i, s["api_key"]) for i, s in enumerate(sessions)))
        return time.perf_counter() - started, firsts


def _added(firsts: list[float], engine_first: list[float]) -> tuple[float, float]:
    """(p50, p99) ms the gateway adds to the engine's first token."""
    return tuple(1000 * (_percentile(firsts, share) - _percentile(engine_first, share))  # type: ignore[return-value]
                 for share in (0.5, 0.99))


def run(quick: bool = False, *, concurrency: int = 64, turns: int = 6) -> dict[str, Any]:
    from rollout_buffer.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir

    tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    trials: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rb-bench-gws-") as tmp:
        work = Path(tmp)
        engine_port, server_port = _free_port(), _free_port()
        engine = _spawn(["test-engine", "--port", str(engine_port), "--seed", "1"], work / "engine.log")
        server = _spawn(["serve", "--port", str(server_port), "--data-dir", str(work / "data"), "--workers", "0",
                         "--log-level", "warning", "--input-root", tokenizer], work / "server.log")
        try:
            engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{server_port}"
            _wait_for(f"{engine_url}/health", engine)
            _wait_for(f"{url}/health", server)
            streamed_config = {"latency_s": LATENCY_S, "token_delay_s": TOKEN_DELAY_S}
            httpx.post(f"{engine_url}/_test/config", json=streamed_config)
            prompt = list(load_qwen_tokenizer("qwen2.5").encode("What is 2 + 3?"))
            with httpx.Client(base_url=url, timeout=120) as client:
                run_id = _start(client, engine_url, tokenizer, "gateway-stream")
                asyncio.run(_turns(url, _sessions(client, run_id, 2), 1, True))  # tokenizer, connections
                _, burst = asyncio.run(_turns(url, _sessions(client, run_id, concurrency), 3, True))  # no spread
                burst_bare = asyncio.run(_engine_first_chunks(engine_url, concurrency, 3, prompt, 0.0))
                for _trial in range(1 if quick else TRIALS):
                    httpx.post(f"{engine_url}/_test/config", json=streamed_config)
                    engine_first = asyncio.run(_engine_first_chunks(engine_url, concurrency, turns, prompt,
                                                                    SPREAD_S))
                    sessions = _sessions(client, run_id, concurrency)
                    counted = httpx.get(f"{engine_url}/_test/stats").json()
                    before = cpu_seconds_precise(server.pid)
                    streamed_s, firsts = asyncio.run(_turns(url, sessions, turns, True, SPREAD_S))
                    streamed_cpu = cpu_seconds_precise(server.pid) - before
                    stats = httpx.get(f"{engine_url}/_test/stats").json()
                    tokens_per_call = (stats["generated_tokens"] - counted["generated_tokens"]) / max(
                        1, stats["requests"] - counted["requests"])
                    plain_latency_s = LATENCY_S + tokens_per_call * TOKEN_DELAY_S  # the same engine time per turn
                    httpx.post(f"{engine_url}/_test/config", json={"latency_s": plain_latency_s})
                    sessions = _sessions(client, run_id, concurrency)
                    before = cpu_seconds_precise(server.pid)
                    plain_s, _ = asyncio.run(_turns(url, sessions, turns, False, SPREAD_S))
                    plain_cpu = cpu_seconds_precise(server.pid) - before
                    p50, p99 = _added(firsts, engine_first)
                    trials.append({"added_p50_ms": p50, "added_p99_ms": p99, "firsts": firsts,
                                   "engine_first": engine_first, "streamed_s": streamed_s, "plain_s": plain_s,
                                   "cpu_s": {"streamed": streamed_cpu, "plain": plain_cpu},
                                   "tokens_per_call": tokens_per_call, "plain_latency_s": plain_latency_s})
        finally:
            for proc in (server, engine):
                _stop(proc)
    calls = concurrency * turns
    best = min(trials, key=lambda t: t["added_p99_ms"])
    firsts, engine_first = best["firsts"], best["engine_first"]
    streamed_s = min(t["streamed_s"] for t in trials)
    plain_s = min(t["plain_s"] for t in trials)
    cpu = {mode: min(t["cpu_s"][mode] for t in trials) for mode in ("streamed", "plain")}
    burst_p50, burst_p99 = _added(burst, burst_bare)
    return {"concurrency": concurrency, "turns": turns, "latency_s": LATENCY_S, "token_delay_s": TOKEN_DELAY_S,
            "spread_s": SPREAD_S, "trials": [{k: v for k, v in t.items() if k not in ("firsts", "engine_first")}
                                             for t in trials],
            "first_token_ms": {"gateway_p50": 1000 * _percentile(firsts, 0.5),
                               "gateway_p99": 1000 * _percentile(firsts, 0.99),
                               "engine_p50": 1000 * _percentile(engine_first, 0.5),
                               "engine_p99": 1000 * _percentile(engine_first, 0.99),
                               "engine_mean": 1000 * statistics.fmean(engine_first)},
            "burst_added_ms": {"p50": burst_p50, "p99": burst_p99},
            "tokens_per_call": best["tokens_per_call"], "plain_latency_s": best["plain_latency_s"],
            "added_p50_ms": best["added_p50_ms"], "added_p99_ms": best["added_p99_ms"],
            "streamed_turns_per_s": calls / streamed_s, "plain_turns_per_s": calls / plain_s,
            "ratio": plain_s / streamed_s, "cpu_ms_per_turn": {mode: 1000 * s / calls for mode, s in cpu.items()}}


def main() -> int:
    r = run()
    ms = r["first_token_ms"]
    print(f"first streamed byte through the gateway, {r['concurrency']} streams: +{r['added_p50_ms']:.1f} ms p50, "
          f"+{r['added_p99_ms']:.1f} ms p99 over the engine's ({ms['engine_p50']:.0f} / {ms['engine_p99']:.0f} ms; "
          f"target p99 < 20 ms); trials: " + ", ".join(f"+{t['added_p50_ms']:.1f} / +{t['added_p99_ms']:.1f}"
                                                    for t in r["trials"])
          + f"; all starting at once (burst): +{r['burst_added_ms']['p50']:.1f} / +{r['burst_added_ms']['p99']:.1f}")
    print(f"turns/s streamed {r['streamed_turns_per_s']:.1f}, not streamed {r['plain_turns_per_s']:.1f} (engine "
          f"{r['plain_latency_s'] * 1000:.0f} ms a call: {r['tokens_per_call']:.0f} tokens a call at "
          f"{r['token_delay_s'] * 1000:.0f} ms) "
          f"(ratio {r['ratio']:.2f}, target >= 0.9); the API process's CPU per turn: streamed "
          f"{r['cpu_ms_per_turn']['streamed']:.2f} ms, not streamed {r['cpu_ms_per_turn']['plain']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
