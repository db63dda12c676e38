"""`rollout-buffer demo` runs the whole loop on one machine and shows what the trainer receives."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runtime_helpers import REPO


def test_demo_runs_end_to_end_quickly() -> None:
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "demo", "--prompts", "3", "--repeats", "2",
                           "--latency-s", "0"], check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "3 groups, 6 trajectories" in out
    assert '"turns"' in out and '"raw_reward"' in out and "GRPO rewards" in out
    assert "'done': 6" in out and "'failed': 0" in out
