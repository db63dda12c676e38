"""The runtime behind the real SGLang model gateway (`sglang-router`, PyPI) in front of two test engines, each
its own process: token-in/token-out `/generate` through the router, every rollout's turns kept on one
engine by `X-SMG-Routing-Key` (the router's `manual` policy honours it), and one engine SIGKILLed mid-run
costing retries and counted failures, never a hung run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import REPO, ServerProcess, free_port
from tests.support.process_tools import wait_for
from tests.support.runtime_helpers import (
    arithmetic_rows,
    assert_exact_turns,
    assert_whole_groups,
    drain,
    start_native,
    wait_status,
    write_rows,
)

pytest.importorskip("sglang_router", reason="sglang-router (the SGLang model gateway) cannot be installed here; "
                                            "`pip install sglang-router` to run these tests")

pytestmark = pytest.mark.timeout(240)


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def router_with_engines(tmp_path: Path, latency_s: float, *router_args: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Two `rollout-buffer test-engine` processes (ids A and B) behind `sglang-router` (manual policy, health
    checked every second); yields the router URL and {engine id: (url, process)}."""
    engines: dict[str, Any] = {}
    with ExitStack() as stack:
        for engine_id in ("A", "B"):
            port = free_port()
            proc = stack.enter_context(process(
                [sys.executable, "-m", "rollout_buffer.cli", "test-engine", "--port", str(port), "--engine-id",
                 engine_id, "--latency-s", str(latency_s), "--seed", "3"], tmp_path / f"engine-{engine_id}.log"))
            engines[engine_id] = (f"http://127.0.0.1:{port}", proc)
        for url, _ in engines.values():
            wait_for(lambda url=url: _answers(f"{url}/health"), 60, f"test engine {url}")
        router_port = free_port()
        stack.enter_context(process(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
             "--worker-urls", *(url for url, _ in engines.values()), "--policy", "manual",
             "--health-check-interval-secs", "1", "--log-level", "warn", *router_args], tmp_path / "router.log"))
        router = f"http://127.0.0.1:{router_port}"
        wait_for(lambda: _healthy_workers(router) == 2, 60, "the router with both engines healthy")
        yield router, engines


def _healthy_workers(router: str) -> int:
    try:
        workers = httpx.get(f"{router}/workers", timeout=1).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(1 for worker in workers if worker.get("is_healthy"))


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/_test/stats", timeout=5).json()


def _keys(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/_test/routing_keys", timeout=5).json()


@pytest.fixture()
def client(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=30) as c:
        yield c


def test_rollouts_through_the_router_are_token_exact_sticky_and_use_both_engines(
        client: httpx.Client, tmp_path: Path, qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(16)
    with router_with_engines(tmp_path, latency_s=0.05) as (router, engines):
        run_id = start_native(client, write_rows(tmp_path, rows), engine_url=router, tokenizer_path=qwen_tokenizer_path,
                              task_type="calculator", repeats=2, num_process=32)
        records = drain(client, run_id, 32, timeout_s=120)
        keys = {engine_id: _keys(url) for engine_id, (url, _) in engines.items()}
        served = {engine_id: _stats(url)["endpoints"].get("/generate", 0) for engine_id, (url, _) in engines.items()}
        # what docs/workers.md says about aborts behind this router: it does not route /abort_request
        assert httpx.post(f"{router}/abort_request", json={"rid": "x"}, timeout=5).status_code == 404
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    for record in records:
        assert record["status"] == "completed"
        assert_exact_turns(record)
        on = [engine_id for engine_id, seen in keys.items() if record["uid"] in seen]
        assert len(on) == 1, f"{record['uid']}'s turns went to {on}"
        assert keys[on[0]][record["uid"]] == len(record["turns"])
    assert served["A"] > 0 and served["B"] > 0, served
    assert sum(served.values()) == sum(len(r["turns"]) for r in records)
    assert wait_status(client, run_id, "finished")["stats"].get("engine_retries", 0) == 0


def test_an_engine_killed_mid_run_costs_retries_and_counted_failures_not_a_hung_run(
        client: httpx.Client, tmp_path: Path, qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(24)
    # The router's own retries would often carry a killed engine's turns to the other one unseen; without them
    # every such turn reaches the buffer as an error, the harder case: the buffer's retries must carry the run.
    # Enough retries (backoff 0.2 s doubling) to outlast the router's taking the dead engine out even on a
    # busy machine, so the rollouts that were on it go on on the other engine.
    with router_with_engines(tmp_path, 0.3, "--disable-retries", "--health-failure-threshold", "1") as (router, engines):
        run_id = start_native(client, write_rows(tmp_path, rows), engine_url=router, tokenizer_path=qwen_tokenizer_path,
                              task_type="calculator", repeats=2, num_process=16, engine_backoff_s="0.2",
                              engine_retries="8")
        url_b, proc_b = engines["B"]
        wait_for(lambda: _stats(url_b)["in_flight"] > 0 and _stats(engines["A"][0])["in_flight"] > 0, 60,
                 "both engines generating")
        before = _keys(url_b)
        proc_b.send_signal(signal.SIGKILL)
        proc_b.wait(timeout=10)
        started = time.monotonic()
        records = drain(client, run_id, 48, timeout_s=150)
        keys_a = _keys(engines["A"][0])
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    completed = [r for r in records if r["status"] == "completed"]
    failed = [r for r in records if r["status"] == "failed"]
    for record in completed:
        assert_exact_turns(record)
    detail = wait_status(client, run_id, "finished")
    stats = detail["stats"]
    assert stats.get("engine_retries", 0) > 0, stats  # the killed engine's in-flight turns were retried
    assert detail["tasks"]["done"] + detail["tasks"]["failed"] == 48
    assert detail["tasks"]["failed"] == len(failed) == sum(v for k, v in stats.items()
                                                           if k.startswith("rollout_errors:"))
    moved = [uid for uid in before if uid in keys_a]
    assert moved, "rollouts that had started on the killed engine finished on the other one"
    assert completed, f"nothing completed after the kill ({time.monotonic() - started:.1f}s)"
