"""Agent sandboxes: what isolation costs a rollout.

Start + stop: a sandbox made, one command run in it (`true`: a namespace's or a container's start is paid at
its first command), removed; p50 / p99 per backend, made on demand and taken from a pool of 4 made ahead
(`agent.sandbox.pool`). Agent rollouts: 16 at once, each a fresh sandbox with its model relay, one agent
command that makes one model call through the relay to a stand-in model endpoint on loopback, then removed;
rollouts per second in `bwrap` and `docker` against `local` (the baseline: the same work with no isolation,
the agent calling the endpoint directly). A backend this machine cannot run (no bubblewrap, no Docker
Engine) is reported skipped with the reason.

    python -m bench.sandboxes [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from typing import Any

from aiohttp import web

from rollout_buffer.agents.pool import Prepared, SandboxPool, prepare
from rollout_buffer.agents.sandbox import Limits

AGENT = ("import os, urllib.request; urllib.request.urlopen(urllib.request.Request(os.environ['MODEL_URL'] + "
         "'/v1/chat/completions', data=b'{}', method='POST'), timeout=30).read()")
LIMITS = Limits(pids=128, disk_mb=256)


IMAGE: dict[str, str] = {}  # the docker rows' image, found by `unavailable`


def _options(backend: str) -> dict[str, Any]:
    return {"image": IMAGE["docker"]} if backend == "docker" else {}


async def _find_image() -> str | None:
    """`ROLLOUT_BUFFER_BENCH_IMAGE`, else the test suite's base image (tests/support/docker_env.py), if the Engine
    has it: any image with python3 does."""
    import aiodocker

    wanted = os.environ.get("ROLLOUT_BUFFER_BENCH_IMAGE")
    async with aiodocker.Docker(url=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")) as docker:
        for image in await docker.images.list():
            for tag in image.get("RepoTags") or []:
                if tag == wanted or (not wanted and tag.startswith("rollout-buffer-test-base:")):
                    return tag
    return None


def unavailable(backend: str) -> str | None:
    """Why this machine cannot run `backend`, or None."""
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return "bubblewrap is not installed"
    if backend == "docker":
        try:
            from rollout_buffer.agents import docker_sandbox  # noqa: F401
        except ImportError as exc:
            return f"the docker backend cannot load: {exc}"
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        if host.startswith("unix://") and not os.path.exists(host.removeprefix("unix://")):
            return f"no Docker Engine at {host}"
        image = asyncio.run(_find_image())
        if image is None:
            return ("no image: set ROLLOUT_BUFFER_BENCH_IMAGE to a local image with python3, or run the docker "
                    "tests once (they build rollout-buffer-test-base)")
        IMAGE["docker"] = image
    return None


async def _stub_model() -> tuple[web.AppRunner, str]:
    async def answer(_request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "4"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": statistics.median(ordered) * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000}


async def start_stop(backend: str, upstream: str, n: int, pool: int) -> dict[str, float]:
    """Latency of make (or take) + `true` + remove, one after another."""

    def make() -> Any:
        return prepare(backend, name="bench", limits=LIMITS, options=_options(backend), upstream=upstream)

    holder = SandboxPool(pool, make, lambda: None) if pool else None
    if holder is not None:  # fill it first: a pool in steady state
        for made in [await make() for _ in range(pool)]:
            holder.ready.append(made)
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        prepared: Prepared = await holder.take() if holder is not None else await make()
        run = await prepared.sandbox.exec(["true"], timeout_s=60)
        await prepared.release()
        samples.append(time.perf_counter() - started)
        assert run.ok, run.stderr
        if holder is not None:  # measure the take, not the refill racing it
            deadline = time.monotonic() + 60
            while len(holder.ready) < pool and time.monotonic() < deadline:
                holder.refill()  # a refill that failed is tried again
                await asyncio.sleep(0.005)
    if holder is not None:
        await holder.close()
    return _percentiles(samples)


async def rollouts(backend: str, upstream: str, total: int, concurrency: int) -> float:
    """Agent rollouts per second, `concurrency` at once."""
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            prepared = await prepare(backend, name="bench", limits=LIMITS, options=_options(backend), upstream=upstream)
            try:
                url = prepared.model_url or upstream
                run = await prepared.sandbox.exec(["python3", "-c", AGENT], timeout_s=60, env={"MODEL_URL": url})
                assert run.ok, run.stderr
            finally:
                await prepared.release()

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    return total / (time.perf_counter() - started)


async def measure(quick: bool) -> dict[str, Any]:
    runner, upstream = await _stub_model()
    n, total = (20, 32) if quick else (100, 160)
    out: dict[str, Any] = {"backends": {}}
    try:
        for backend in ("local", "bwrap", "docker"):
            why = await asyncio.to_thread(unavailable, backend)
            if why:
                out["backends"][backend] = {"skipped": why}
                continue
            out["backends"][backend] = {
                "start_stop": await start_stop(backend, upstream, n, 0),
                "start_stop_pool": await start_stop(backend, upstream, n, 4),
                "rollouts_per_s": await rollouts(backend, upstream, total, 16)}
    finally:
        await runner.cleanup()
    return out


def run(quick: bool = False) -> dict[str, Any]:
    return asyncio.run(measure(quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    local = result["backends"]["local"]["rollouts_per_s"]
    for backend, r in result["backends"].items():
        if "skipped" in r:
            print(f"{backend:>6}: skipped ({r['skipped']})")
            continue
        plain, pooled = r["start_stop"], r["start_stop_pool"]
        print(f"{backend:>6}: start+stop p50 {plain['p50_ms']:.1f} ms p99 {plain['p99_ms']:.1f} ms; pooled p50 "
              f"{pooled['p50_ms']:.1f} ms p99 {pooled['p99_ms']:.1f} ms; 16 concurrent agent rollouts "
              f"{r['rollouts_per_s']:.1f}/s = {r['rollouts_per_s'] / local:.2f}x local")


if __name__ == "__main__":
    main()
