"""What rollouts record, scraped from the API while a `rollout-buffer worker` in another process ran them:
durations, engine latency, tokens (checked against the engine's own count), failures by type with an
example, per-epoch progress and throughput over time."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rollout_buffer.testing.engine import run_engine_in_thread
from tests.support.helpers import ServerProcess
from tests.support.runtime_helpers import WorkerProcess, arithmetic_rows, drain, start_native, wait_status, write_rows

LATENCY_S = 0.05


def scrape(url: str, run_id: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("run_id") == run_id}


def test_a_remote_workers_rollouts_show_in_the_api_metrics(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    rows = arithmetic_rows(8)
    with run_engine_in_thread(template="qwen2.5", seed=3, latency_s=LATENCY_S) as engine, \
            ServerProcess(tmp_path / "data", "--workers", "0",
                          env={"ROLLOUT_BUFFER_TIMELINE_INTERVAL_S": "0.2"}) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        worker = WorkerProcess(tmp_path, "--redis-url", f"unix://{(server.data_dir / 'redis.sock').resolve()}").start()
        try:
            engine.configure(fail_next=3)  # three rollouts fail: engine_retries is 0 below
            run_id = start_native(client, write_rows(tmp_path, rows), engine_url=engine.url,
                                  tokenizer_path=qwen_tokenizer_path, repeats=4, epochs=2, num_process=4,
                                  engine_retries=0)
            records = drain(client, run_id, 64, timeout_s=60)
            wait_status(client, run_id, "finished")
            time.sleep(0.5)  # one more timeline sample after the last rollout
            chat_id = start_native(client, write_rows(tmp_path, rows[:2], "chat.jsonl"), engine_url=engine.url,
                                   tokenizer_path=qwen_tokenizer_path, repeats=2, engine_api="chat")
            drain(client, chat_id, 4, timeout_s=60)
        finally:
            assert worker.signal(signal.SIGTERM) == 0, worker.log()[-3000:]
        engine_stats = engine.stats_dict()
        samples, chat = scrape(server.url, run_id), scrape(server.url, chat_id)
        dashboard = client.get("/api/dashboard", params={"run_id": run_id}).json()

    output_tokens = sum(len(t["output_ids"]) for r in records for t in r.get("turns") or [])
    assert samples[("rollout_buffer_generated_tokens_total", ())] == output_tokens > 0
    assert output_tokens + chat[("rollout_buffer_generated_tokens_total", ())] == engine_stats["generated_tokens"]
    assert chat[("rollout_buffer_engine_call_duration_seconds_count", ())] == 4, "the chat client is timed too"
    calls = samples[("rollout_buffer_engine_calls_total", ())]
    assert calls == 64 and samples[("rollout_buffer_engine_call_duration_seconds_count", ())] == calls
    successful = 64 - 3
    assert samples[("rollout_buffer_engine_call_duration_seconds_sum", ())] >= successful * LATENCY_S
    assert samples[("rollout_buffer_engine_call_duration_seconds_bucket", (("le", "0.025"),))] <= 3, \
        "only the injected errors (answered at once) can be faster than the engine's latency"
    assert samples[("rollout_buffer_rollout_duration_seconds_count", ())] == 64
    assert samples[("rollout_buffer_rollout_duration_seconds_sum", ())] >= successful * LATENCY_S
    assert samples[("rollout_buffer_tasks", (("state", "done"),))] == 61
    assert samples[("rollout_buffer_tasks", (("state", "failed"),))] == 3
    assert samples[("rollout_buffer_rollout_failures_total", (("error_type", "EngineError"),))] == 3
    assert samples[("rollout_buffer_groups", (("state", "handed"),))] == 16

    summary = dashboard["runs"][0] if dashboard["runs"][0]["run_id"] == run_id else dashboard["runs"][1]
    assert summary["epochs"] == [{"epoch": 0, "finished": 32, "total": 32}, {"epoch": 1, "finished": 32, "total": 32}]
    assert summary["progress"] == 1.0 and summary["tasks"]["total"] == 64
    detail = dashboard["run"]
    failure = detail["failures"]["by_type"]["EngineError"]
    assert failure["count"] == 3 and "500" in failure["example"]
    throughput = detail["throughput"]
    assert len(throughput["t"]) >= 2 and max(throughput["rollouts_per_s"]) > 0
    assert throughput["rollouts_per_s"][-1] == 0, "the run is over"
    assert detail["engine_latency"]["count"] == 64 and detail["engine_latency"]["p50"] >= LATENCY_S * 0.5
    assert detail["totals"]["tokens_generated"] == output_tokens
