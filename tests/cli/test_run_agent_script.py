"""scripts/run_agent.sh: starts the buffer, hands training the flags slime needs, stops the buffer after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.helpers import REPO, free_port

SCRIPT = REPO / "scripts" / "run_agent.sh"

# A stand-in for `python train.py ...`: parses the buffer flags as slime's `add_rollout_buffer_arguments`
# declares them (unknown flags ignored), checks the buffer through the URL slime would see, prints its argv.
FAKE_TRAIN = """
import argparse, json, sys, urllib.request
args = sys.argv[1:]
parser = argparse.ArgumentParser()
parser.add_argument("--rollout-buffer-url", type=str, default=None)
parser.add_argument("--loss-mask-type", type=str, default="qwen", choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"])
parser.add_argument("--rollout-function-path", type=str)
slime, _ = parser.parse_known_args(args[1:])
url = slime.rollout_buffer_url
health = json.load(urllib.request.urlopen(url + "/health", timeout=5))
tasks = json.load(urllib.request.urlopen(url + "/tasks", timeout=5))
print(json.dumps({"argv": args, "health": health, "tasks": sorted(tasks["tasks"]),
                  "loss_mask_type": slime.loss_mask_type}), flush=True)
sys.exit(int(args[0]))
"""

SLEEPY_TRAIN = """
import os, time
print(os.getpid(), flush=True)
time.sleep(60)
"""


def script_env(tmp_path: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUFFER_")}
    env.update(PYTHON=sys.executable, BUFFER_PORT=str(port), ROLLOUT_BUFFER_DATA_DIR=str(tmp_path / "data"),
               ROLLOUT_BUFFER_TASK_DIR=str(REPO / "tests" / "fixtures" / "tasks"), HEALTH_TIMEOUT_S="60",
               STOP_TIMEOUT_S="20")
    return env


def assert_port_closed(port: int) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_flags_exit_status_and_the_buffer_is_stopped(tmp_path: Path) -> None:
    port = free_port()
    command = [str(SCRIPT), "--", sys.executable, "-c", FAKE_TRAIN, "7", "--loss-mask-type", "qwen3"]
    done = subprocess.run(command, check=False, env=script_env(tmp_path, port), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 7, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    argv = report["argv"]
    url = f"http://127.0.0.1:{port}"
    assert argv[argv.index("--rollout-function-path") + 1] == "slime_adapter.agent_rollout.generate_rollout"
    assert argv[argv.index("--rollout-buffer-url") + 1] == url, "slime's own flag, the one its parser reads"
    assert "--agent-rollout-buffer-url" not in argv
    assert report["loss_mask_type"] == "qwen3"
    assert argv.count("--loss-mask-type") == 1 and argv[argv.index("--loss-mask-type") + 1] == "qwen3", \
        "a flag the command already gives is not appended again"
    assert report["health"]["status"] == "ok" and "external" in report["tasks"], "the task dir was passed"
    assert "buffer stopped" in done.stderr
    assert_port_closed(port)
    assert (tmp_path / "data" / "buffer.log").is_file()


def test_sigterm_stops_training_and_buffer(tmp_path: Path) -> None:
    port = free_port()
    env = {**script_env(tmp_path, port), "LOSS_MASK_TYPE": "distill_qwen"}
    proc = subprocess.Popen([str(SCRIPT), "--", sys.executable, "-c", SLEEPY_TRAIN], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        train_pid = int(proc.stdout.readline())  # training runs, so the buffer is healthy
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert time.monotonic() - began < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        os.kill(train_pid, 0)
    assert_port_closed(port)
