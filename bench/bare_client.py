"""The rollout benchmark's baseline: plain aiohttp tasks sending the very `/generate` calls a run made, with
no runtime around them (no Redis, no task stream, no chat template, no record writing).

Each rollout is replayed as its turns' requests in order, one after the other, exactly as the runtime
sent them (same prompt ids, sampling params, rid and routing key, so the seeded test engine generates
the same tokens and does the same work); all rollouts start at once, `concurrency` in flight at most.
It runs on the same event loop as the workers (uvloop) and reads and parses every answer, so the
difference to the runtime is the runtime's own work.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

ROUTING_HEADER = "X-SMG-Routing-Key"


def replay_requests(records: list[dict[str, Any]], sampling_params: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per rollout, the `/generate` bodies its turns were generated with (first attempt, no abort pieces:
    the benchmark's engine injects no faults)."""
    rollouts = []
    for record in records:
        bodies = []
        for index, turn in enumerate(record["turns"]):
            bodies.append({"input_ids": turn["prompt_ids"], "return_logprob": True,
                           "sampling_params": dict(sampling_params), "rid": f"{record['uid']}:{index}:0:1",
                           "_key": record["uid"]})
        rollouts.append(bodies)
    return rollouts


async def _replay(url: str, rollouts: list[list[dict[str, Any]]], concurrency: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)
    calls = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(bodies: list[dict[str, Any]]) -> None:
            nonlocal calls
            async with gate:
                for body in bodies:
                    payload = {k: v for k, v in body.items() if k != "_key"}
                    async with session.post(f"{url}/generate", data=orjson.dumps(payload),
                                            headers={"Content-Type": "application/json",
                                                     ROUTING_HEADER: body["_key"]}) as response:
                        answer = orjson.loads(await response.read())
                    if response.status != 200 or "meta_info" not in answer:
                        raise RuntimeError(f"baseline call failed: HTTP {response.status}: {answer}")
                    calls += 1

        started = time.perf_counter()
        await asyncio.gather(*(one(bodies) for bodies in rollouts))
        return time.perf_counter() - started, calls


def run_baseline(url: str, rollouts: list[list[dict[str, Any]]], concurrency: int) -> tuple[float, int]:
    """(seconds from the first call to the last answer, calls made)."""
    from rollout_buffer.runtime.worker_main import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_replay(url, rollouts, concurrency))
