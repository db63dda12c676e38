"""`rollout-buffer demo --agent` runs an agent command per rollout end to end and shows the records."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runtime_helpers import REPO


def test_demo_agent_runs_end_to_end() -> None:
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "demo", "--agent", "--prompts", "3",
                           "--repeats", "2", "--latency-s", "0"], check=False, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "3 groups, 6 trajectories" in out
    assert '"task_type"' not in out and '"agent": {' in out and '"exit_code": 0' in out and '"verifier": {' in out
    assert '"session_id"' in out and '"turns"' in out
    assert "'done': 6" in out and "'failed': 0" in out
