"""Take the dashboard screenshot of docs/metrics.md: a real server, the test engine, a trainer-like reader, Chromium.

    python scripts/dashboard_screenshot.py [docs/dashboard.png]

Runs from the repository root (it uses the test helpers in `tests/`). A math run of 128 prompts x 8
rollouts x 2 epochs against the test engine (0.2 s latency with jitter, 3% of engine calls failing; no
retries, so they become failed rollouts), read by a leased reader in steps of 8 groups. The engine answers
right more often after every step (its `p_correct` climbs from 0.3 to 0.85), as a policy that learns
would. The page is captured while the second epoch is being rolled out.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout_buffer.testing.engine import run_engine_in_thread  # noqa: E402
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir  # noqa: E402
from tests.support.browser import OfflineBrowser  # noqa: E402
from tests.support.helpers import ServerProcess  # noqa: E402
from tests.support.runtime_helpers import arithmetic_rows, start_native, write_rows  # noqa: E402


def read_steps(url: str, run_id: str, engine: Any, stop: threading.Event) -> None:
    """A trainer: leased reads of 8 groups (64 samples), each acknowledged, until stopped; every step makes
    the engine's answers a little better."""
    with httpx.Client(base_url=url, timeout=30) as client:
        step = 0
        while not stop.is_set():
            answer = client.post("/get_rollout_data", json={"run_id": run_id, "num": 64, "wait_s": 2, "lease_s": 120,
                                                            "batch_id": f"step-{step}"}).json()
            if answer["data"]["data"]:
                client.post("/ack", json={"run_id": run_id, "batch_id": f"step-{step}"})
                step += 1
                engine.configure(p_correct=min(0.85, 0.3 + 0.025 * step))
                time.sleep(0.3)  # the training step


def main(out: Path) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="dashboard-shot-"))
    stop = threading.Event()
    try:
        with run_engine_in_thread(template="qwen2.5", seed=11, latency_s=0.2, latency_jitter_s=0.15,
                                  error_rate=0.03, p_correct=0.3) as engine, \
                ServerProcess(tmp / "data", env={"ROLLOUT_BUFFER_TIMELINE_INTERVAL_S": "1"}) as server, \
                httpx.Client(base_url=server.url, timeout=30) as client:
            run_id = start_native(client, write_rows(tmp, arithmetic_rows(128)), engine_url=engine.url,
                                  tokenizer_path=str(qwen_tokenizer_dir("qwen2.5")), repeats=8, epochs=2,
                                  num_process=32, engine_retries=0)
            reader = threading.Thread(target=read_steps, args=(server.url, run_id, engine, stop), daemon=True)
            reader.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                tasks = client.get(f"/runs/{run_id}").json()["tasks"]
                if tasks["done"] + tasks["failed"] >= 900:
                    break
                time.sleep(0.5)
            with OfflineBrowser(tmp) as browser:
                visit = browser.open(f"{server.url}/?refresh=1", wait_for='[data-chart="throughput"] canvas',
                                     wait_until="load")
                visit.page.wait_for_function("Number(document.body.dataset.updates || 0) >= 2")
                shot = visit.screenshot("dashboard.png")
                assert not visit.outside_requests(), visit.outside_requests()
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, out)
            print(f"saved {out}")
            stop.set()
            reader.join(timeout=10)
    finally:
        stop.set()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "dashboard.png"))
