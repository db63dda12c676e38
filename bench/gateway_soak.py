"""Gateway soak: a long-lived server with many agent sessions stays flat in memory and in `/metrics`.

One real `rollout-buffer serve` (embedded Redis, a token) and the test engine in this process. For
`--minutes`, `--open` sessions (default 1,000) are kept open at once in an external run, each taking a few
turns through the OpenAI gateway, one of them a fork (an edited answer), then finished; a trainer loop reads
every group with a lease and acks it. Mixed in: requests with unknown fields (a session create and a finish
with a misspelled field, refused 4xx; a chat call with a random unknown field, counted under a bounded
label) and slow clients (connections that send their headers a byte at a time and never finish them).
Runs rotate every `--run-s` seconds; a run whose sessions are finished and whose groups are read is deleted
(the soak's retention), so what finished sessions stored leaves Redis with it.

Every `--sample-s` the API process's RSS, Redis `used_memory` and the size of `/metrics` are sampled.
After the warm-up (`--warmup-s`), each series is flat when the mean of its last quarter is within
`--max-growth` of its first quarter's; the slope (least squares, per minute, relative to the mean) is
printed too.

    python -m bench.gateway_soak [--minutes 10] [--open 1000] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

REPO = Path(__file__).resolve().parent.parent
TOKEN = "soak-" + uuid.uuid4().hex
SYSTEM = "You are a careful assistant. Check every step of your arithmetic and answer briefly. " * 6


@dataclass
class Counts:
    """What the load did, by kind; a soak that got no answers measured nothing."""

    sessions: int = 0
    turns: int = 0
    forks: int = 0
    refused_unknown: int = 0
    unexpected: dict[str, int] = field(default_factory=dict)
    slow_opened: int = 0
    slow_closed_by_server: int = 0
    groups_read: int = 0
    runs_deleted: int = 0
    retried: int = 0  # requests sent again after a transport error

    def bad(self, what: str) -> None:
        self.unexpected[what] = self.unexpected.get(what, 0) + 1


RETRIES = 3


async def send(http: httpx.AsyncClient, counts: Counts, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request, sent again on a transport error (a keep-alive connection the server closed as this one
    went out): every request here is idempotent (creates carry an Idempotency-Key, turns replay, reads
    name their batch), as a real client's retry would be."""
    for attempt in range(RETRIES + 1):
        try:
            return await http.request(method, url, **kwargs)
        except httpx.TransportError:
            if attempt == RETRIES:
                raise
            counts.retried += 1
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


@dataclass
class Runs:
    """The run new sessions join, and the older runs waiting to be drained and deleted."""

    current: str = ""
    open_sessions: dict[str, int] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)
    released: list[dict[str, Any]] = field(default_factory=list)  # per deleted run: bytes before, keys after


async def _start_run(http: httpx.AsyncClient, counts: Counts, engine_url: str, tokenizer: str) -> str:
    run_id = f"soak-{uuid.uuid4().hex[:10]}"
    body = {"task_type": "external", "remote_engine_url": engine_url, "tokenizer_path": tokenizer,
            "num_repeat_per_sample": 1, "run_id": run_id, "activate": False,
            "sampling_params": {"max_tokens": 24, "temperature": 1.0}}
    (await send(http, counts, "POST", "/start_rollout", json=body)).raise_for_status()
    return run_id


async def _chat(http: httpx.AsyncClient, counts: Counts, session: dict[str, Any], messages: list[dict[str, Any]],
                extra: dict[str, Any] | None = None) -> httpx.Response:
    return await send(http, counts, "POST", f"{session['openai_base_url']}/chat/completions",
                           json={"model": "m", "messages": messages, **(extra or {})},
                           headers={"Authorization": f"Bearer {session['api_key']}"})


async def one_session(http: httpx.AsyncClient, runs: Runs, counts: Counts, rng: random.Random,
                      think_s: float) -> None:
    """Open a session, take 3-5 turns (one a fork, one with an unknown field), finish it."""
    run_id = runs.current
    runs.open_sessions[run_id] = runs.open_sessions.get(run_id, 0) + 1
    try:
        if rng.random() < 0.1:  # a misspelled field: refused, nothing stored
            answer = await send(http, counts, "POST", f"/runs/{run_id}/sessions",
                                json={"instance_id": "x", "instance_idd": "y"})
            if answer.status_code // 100 == 4 and "instance_idd" in answer.text:
                counts.refused_unknown += 1
            else:
                counts.bad(f"create with an unknown field answered {answer.status_code}")
        answer = await send(http, counts, "POST", f"/runs/{run_id}/sessions",
                            json={"instance_id": f"i{uuid.uuid4().hex[:12]}"},
                            headers={"Idempotency-Key": uuid.uuid4().hex})
        if answer.status_code != 200:
            counts.bad(f"create answered {answer.status_code}")
            return
        session = answer.json()
        counts.sessions += 1
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": f"What is {rng.randint(2, 99)} * 7?"}]
        turns = rng.randint(3, 5)
        fork_at = rng.randint(1, turns - 1)
        for turn in range(turns):
            extra = {f"x_{uuid.uuid4().hex[:8]}": 1} if rng.random() < 0.2 else None  # ignored, counted as other
            if turn == fork_at:  # the agent rewrites its last answer: a fork
                edited = [*messages[:-2], {"role": "assistant", "content": "Let me redo that."}, messages[-1]]
                messages = edited
                counts.forks += 1
            reply = await _chat(http, counts, session, messages, extra)
            if reply.status_code != 200:
                counts.bad(f"turn answered {reply.status_code}")
                return
            counts.turns += 1
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "And plus 3?"}]
            await asyncio.sleep(rng.uniform(0.5, 1.5) * think_s)  # the agent's own time between turns
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        if rng.random() < 0.1:
            wrong = await send(http, counts, "POST", f"/sessions/{session['session_id']}/finish",
                               json={"reward": 1.0, "rewrad": 1}, headers=headers)
            if wrong.status_code // 100 == 4 and "rewrad" in wrong.text:
                counts.refused_unknown += 1
            else:
                counts.bad(f"finish with an unknown field answered {wrong.status_code}")
        done = await send(http, counts, "POST", f"/sessions/{session['session_id']}/finish",
                          json={"reward": rng.random()}, headers=headers)
        if done.status_code != 200:
            counts.bad(f"finish answered {done.status_code}")
    finally:
        runs.open_sessions[run_id] -= 1


async def agents(http: httpx.AsyncClient, runs: Runs, counts: Counts, open_target: int, think_s: float,
                 stop: float) -> None:
    """Keep `open_target` sessions going until `stop`; each finished one is replaced."""
    rng = random.Random(1)
    active: set[asyncio.Task[None]] = set()
    while time.monotonic() < stop:
        while len(active) < open_target and time.monotonic() < stop:
            active.add(asyncio.create_task(one_session(http, runs, counts, random.Random(rng.random()), think_s)))
        done, active = await asyncio.wait(active, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                counts.bad(type(task.exception()).__name__)
    if active:
        done, _ = await asyncio.wait(active, timeout=120)
        for task in done:
            if task.exception() is not None:
                counts.bad(type(task.exception()).__name__)


async def slow_clients(port: int, counts: Counts, connections: int, stop: float) -> None:
    """Slowloris: connections that send a request line and then a header byte every second, never ending
    their headers; the server closes them (its header timeout), and each is opened again."""
    async def one() -> None:
        while time.monotonic() < stop:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(1)
                continue
            counts.slow_opened += 1
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                while time.monotonic() < stop:
                    await writer.drain()
                    if await _closed(reader):
                        counts.slow_closed_by_server += 1
                        break
                    writer.write(b"a")
            except (ConnectionError, OSError):
                counts.slow_closed_by_server += 1
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server answered or ended the connection within a second (it never owes an answer)."""
    try:
        await asyncio.wait_for(reader.read(4096), timeout=1.0)
    except asyncio.TimeoutError:
        return False
    return True


async def trainer(http: httpx.AsyncClient, runs: Runs, counts: Counts, direct: redis.Redis, stop: float) -> None:
    """Read every run's groups with a lease and ack them; delete a retired run once drained."""
    from rollout_buffer.store import keys

    reads = 0
    while time.monotonic() < stop or runs.retired:
        for run_id in list(dict.fromkeys([runs.current, *runs.retired])):
            idle = run_id in runs.retired and runs.open_sessions.get(run_id, 0) == 0  # before the read: then
            if run_id not in runs.retired and run_id != runs.current:
                continue  # deleted in this pass
            reads += 1
            reply = await send(http, counts, "POST", "/get_rollout_data",
                               json={"run_id": run_id, "num": 256, "wait_s": 0.2, "lease_s": 60,
                                     "batch_id": f"soak-read-{reads}"})
            if reply.status_code != 200:
                raise RuntimeError(f"a read of {run_id} answered {reply.status_code}: {reply.text[:300]}")
            answer = reply.json()
            if answer["success"] is False and answer["data"]["data"]:
                counts.bad("a read that failed with records")
            records = answer["data"]["data"]
            if records:
                counts.groups_read += len(records)
                await send(http, counts, "POST", "/ack",
                           json={"run_id": run_id, "batch_ids": [answer["data"]["meta_info"]["batch_id"]]})
            elif idle:  # an empty read after the last session finished: nothing more will come
                run_keys = [k for k in keys.run_keys(run_id)]
                held = sum(int(direct.memory_usage(k, samples=0) or 0) for k in run_keys if direct.exists(k))
                sessions = sum(int(direct.memory_usage(k, samples=0) or 0)
                               for k in (keys.session_nodes(run_id), keys.session_index(run_id)) if direct.exists(k))
                (await send(http, counts, "DELETE", f"/runs/{run_id}")).raise_for_status()
                left = [k for k in run_keys if direct.exists(k) and k != keys.run_meta(run_id)]
                runs.released.append({"run_id": run_id, "bytes_before": held, "session_bytes_before": sessions,
                                      "keys_left": left})
                runs.retired.remove(run_id)
                counts.runs_deleted += 1
        if time.monotonic() >= stop and not any(runs.open_sessions.get(r, 0) for r in runs.retired):
            if not runs.retired:
                break
        await asyncio.sleep(0.2)


def _metrics_bytes(url: str) -> int:
    return len(httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).content)


async def sampler(url: str, api: psutil.Process, direct: redis.Redis, counts: Counts, samples: list[dict[str, Any]],
                  every_s: float, started: float, stop: float) -> None:
    while time.monotonic() < stop:
        try:
            metrics = await asyncio.to_thread(_metrics_bytes, url)
        except httpx.TransportError:
            counts.retried += 1
            await asyncio.sleep(every_s)
            continue
        samples.append({"t": round(time.monotonic() - started, 1), "api_rss_mb": api.memory_info().rss / 2**20,
                        "redis_used_mb": int(direct.info("memory")["used_memory"]) / 2**20,
                        "metrics_kb": metrics / 1024, "turns": counts.turns, "load": os.getloadavg()[0]})
        await asyncio.sleep(every_s)


async def rotate(http: httpx.AsyncClient, runs: Runs, counts: Counts, engine_url: str, tokenizer: str, every_s: float,
                 stop: float) -> None:
    while time.monotonic() + every_s < stop:
        await asyncio.sleep(every_s)
        old, runs.current = runs.current, await _start_run(http, counts, engine_url, tokenizer)
        runs.retired.append(old)


def flatness(samples: list[dict[str, Any]], key: str, warmup_s: float) -> dict[str, float]:
    """First-vs-last-quarter ratio and the relative slope per minute of one series after the warm-up."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 4:
        raise RuntimeError(f"only {len(after)} samples after the warm-up: run longer or sample more often")
    quarter = max(1, len(after) // 4)
    first = sum(s[key] for s in after[:quarter]) / quarter
    last = sum(s[key] for s in after[-quarter:]) / quarter
    ts, ys = [s["t"] / 60 for s in after], [s[key] for s in after]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / (sum((t - mt) ** 2 for t in ts) or 1.0)
    return {"first_quarter": first, "last_quarter": last, "ratio": last / first if first else float("inf"),
            "slope_per_min": slope / my if my else 0.0, "max": max(ys), "min": min(ys)}


async def _soak(server_url: str, port: int, api: psutil.Process, direct: redis.Redis, engine_url: str,
                tokenizer: str, args: argparse.Namespace) -> dict[str, Any]:
    counts, runs, samples = Counts(), Runs(), []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=server_url, timeout=120, limits=limits,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        runs.current = await _start_run(http, counts, engine_url, tokenizer)
        started = time.monotonic()
        stop = started + args.minutes * 60
        # the trainer has its own connections: it never waits for one behind a thousand agents' requests
        async with httpx.AsyncClient(base_url=server_url, timeout=120,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as reader:
            await asyncio.gather(
                agents(http, runs, counts, args.open, args.think_s, stop),
                slow_clients(port, counts, args.slow, stop),
                trainer(reader, runs, counts, direct, stop),
                sampler(server_url, api, direct, counts, samples, args.sample_s, started, stop),
                rotate(http, runs, counts, engine_url, tokenizer, args.run_s, stop))
            runs.retired.append(runs.current)
            await trainer(reader, runs, counts, direct, time.monotonic())  # drain and delete the last run too
        final_redis = int(direct.info("memory")["used_memory"]) / 2**20
    series = {key: flatness(samples, key, args.warmup_s) for key in ("api_rss_mb", "redis_used_mb", "metrics_kb")}
    flat = all(s["ratio"] <= 1 + args.max_growth for s in series.values())
    released = all(not r["keys_left"] for r in runs.released) and bool(runs.released)
    return {"minutes": args.minutes, "open": args.open, "slow": args.slow, "warmup_s": args.warmup_s,
            "counts": counts.__dict__, "series": series, "samples": samples, "released": runs.released,
            "redis_used_mb_after_all_deleted": final_redis, "load_average": os.getloadavg(),
            "ok": flat and released and not counts.unexpected and counts.turns > 0}


def run(minutes: float = 10.0, open_sessions: int = 1000, slow: int = 50, warmup_s: float = 180.0,
        run_s: float = 60.0, sample_s: float = 5.0, max_growth: float = 0.10, think_s: float = 30.0) -> dict[str, Any]:
    """The soak as a function (the tests run it briefly)."""
    args = argparse.Namespace(minutes=minutes, open=open_sessions, slow=slow, warmup_s=warmup_s, run_s=run_s,
                              sample_s=sample_s, max_growth=max_growth, think_s=think_s)
    sys.path.insert(0, str(REPO))
    from rollout_buffer.testing.engine import run_engine_in_thread
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
    from tests.support.helpers import ServerProcess

    tokenizer = str(qwen_tokenizer_dir("qwen2.5"))
    with tempfile.TemporaryDirectory(prefix="rb-gw-soak-") as tmp, \
            run_engine_in_thread(template="qwen2.5", seed=5) as engine, \
            ServerProcess(Path(tmp) / "data", "--session-timeout-s", "300", "--header-timeout-s", "5",
                          env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}) as server:
        assert server.proc is not None
        api = psutil.Process(server.proc.pid)
        with redis.Redis(unix_socket_path=str(Path(tmp) / "data" / "redis.sock")) as direct:
            return asyncio.run(_soak(server.url, server.port, api, direct, engine.url, tokenizer, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to drive the server (default 10)")
    parser.add_argument("--open", type=int, default=1000, help="sessions kept open at once (default 1000)")
    parser.add_argument("--slow", type=int, default=50, help="slow clients held at once (default 50)")
    parser.add_argument("--warmup-s", type=float, default=180.0,
                        help="samples before this are not judged (default 180: a session lives ~2 minutes, so "
                             "runs are deleted as fast as they start only after that)")
    parser.add_argument("--run-s", type=float, default=60.0, help="a new run every this many seconds")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--think-s", type=float, default=30.0,
                        help="an agent's mean time between turns (default 30: 1,000 agents offer ~30 turns/s, "
                             "what 2 shared cores serve; offered more, the backlog grows and nothing is flat)")
    parser.add_argument("--max-growth", type=float, default=0.10, help="last quarter over first, at most 1 + this")
    parser.add_argument("--json", type=Path, help="write the result (every sample included) here")
    parser.add_argument("--quick", action="store_true", help="1 minute, 100 sessions open, 10 slow clients")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.open, args.slow, args.warmup_s, args.run_s, args.sample_s = 1.0, 100, 10, 15.0, 15.0, 2.0
        args.think_s = 0.5
    r = run(args.minutes, args.open, args.slow, args.warmup_s, args.run_s, args.sample_s, args.max_growth,
            args.think_s)
    if args.json is not None:
        args.json.write_text(json.dumps(r, indent=1, default=str))
    c = r["counts"]
    print(f"gateway soak: {r['minutes']:g} min, {r['open']} sessions open at once, {r['slow']} slow clients; "
          f"{c['sessions']} sessions, {c['turns']} turns, {c['forks']} forks, {c['refused_unknown']} unknown-field "
          f"requests refused, {c['groups_read']} groups read, {c['runs_deleted']} runs deleted; slow connections "
          f"{c['slow_opened']} opened, {c['slow_closed_by_server']} closed by the server; {c['retried']} requests "
          "sent again after a transport error")
    for key, s in r["series"].items():
        print(f"  {key:14s} first quarter {s['first_quarter']:8.1f}  last quarter {s['last_quarter']:8.1f}  "
              f"ratio {s['ratio']:.3f}  slope {s['slope_per_min']:+.2%}/min  (min {s['min']:.1f}, max {s['max']:.1f})")
    print(f"  Redis used_memory once every run was deleted: {r['redis_used_mb_after_all_deleted']:.1f} MB; runs "
          f"deleted with keys left: {sum(1 for x in r['released'] if x['keys_left'])}; unexpected: "
          f"{c['unexpected'] or 'none'}; load average {', '.join(f'{x:.1f}' for x in r['load_average'])}")
    print("PASS" if r["ok"] else "FAIL")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
