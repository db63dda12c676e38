"""A buffer SIGKILLed with remote rollouts in every state: after the restart each trainer gets its one
callback (ERROR for the rollout that was running, the stored COMPLETED one that was undelivered, and the
queued one is run); a clean shutdown reports the rollout it interrupts."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.remote.test_remote_protocol import FAST_CALLBACKS, TASKS, init_body
from tests.support.helpers import ServerProcess
from tests.support.recording_trainer import run_recording_trainer_in_thread

ENV = {**FAST_CALLBACKS, "ROLLOUT_BUFFER_REMOTE_OWNER_TTL_S": "1", "ROLLOUT_BUFFER_REMOTE_MAX_CONCURRENCY": "1"}


def wait_state(server: ServerProcess, rollout_id: str, check: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{server.url}/init/{rollout_id}", timeout=30).json()
        if check(state):
            return state
        assert time.monotonic() < deadline, f"{rollout_id}: state never matched: {state}"
        time.sleep(0.05)


def test_rollouts_in_flight_at_sigkill_are_reported_after_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with run_recording_trainer_in_thread(template="qwen2.5", seed=3, noise_tokens=(0, 0)) as trainer:
        server = ServerProcess(data, "--task-dir", TASKS, "--workers", "0", env=ENV).start()
        try:
            # B finishes, but the trainer refuses every callback attempt until after the restart.
            trainer.fail_callbacks(100_000, "500")
            finished = init_body(trainer)
            assert httpx.post(f"{server.url}/init", json=finished, timeout=30).status_code == 202
            wait_state(server, finished["rollout_id"],
                       lambda s: s["status"] == "completed" and s["callback"]["attempts"] >= 2)
            # A is mid-rollout (one trainer call made, then sleeping) and holds the only slot ...
            running = init_body(trainer, task_type="remote_faults", tools=False, metadata={"mode": "sleep"})
            assert httpx.post(f"{server.url}/init", json=running, timeout=30).status_code == 202
            trainer.wait_for_calls(running["rollout_id"], 1)
            wait_state(server, running["rollout_id"], lambda s: s["status"] == "running")
            # ... so C waits in the queue.
            queued = init_body(trainer)
            assert httpx.post(f"{server.url}/init", json=queued, timeout=30).status_code == 202
            time.sleep(0.3)
            assert httpx.get(f"{server.url}/init/{queued['rollout_id']}", timeout=30).json()["status"] == "queued"
        finally:
            server.kill(signal.SIGKILL)
        trainer.clear_callback_failures()
        attempts_before = len(trainer.recorded(finished["rollout_id"])["callback_attempts"])
        with ServerProcess(data, "--task-dir", TASKS, "--workers", "0", env=ENV) as restarted:
            error = trainer.wait_for_completion(running["rollout_id"], timeout_s=30)
            assert error["status"] == "ERROR" and "restarted" in error["error"]
            done = trainer.wait_for_completion(finished["rollout_id"], timeout_s=30)
            assert done["status"] == "COMPLETED" and done["reward"] == 1.0
            resumed = trainer.wait_for_completion(queued["rollout_id"], timeout_s=30)
            assert resumed["status"] == "COMPLETED" and resumed["reward"] == 1.0
            states = {rid: wait_state(restarted, rid, lambda s: s["callback"]["delivered"])
                      for rid in (running["rollout_id"], finished["rollout_id"], queued["rollout_id"])}
            # A clean shutdown (SIGTERM) reports what it interrupts instead of leaving it to the next start.
            interrupted = init_body(trainer, task_type="remote_faults", tools=False, metadata={"mode": "sleep"})
            assert httpx.post(f"{restarted.url}/init", json=interrupted, timeout=30).status_code == 202
            trainer.wait_for_calls(interrupted["rollout_id"], 1)
        shut = trainer.wait_for_completion(interrupted["rollout_id"], timeout_s=5)
        assert shut["status"] == "ERROR" and "shut down" in shut["error"]
        for rid, state in states.items():
            assert state["takeovers"] == 1, state
            assert trainer.recorded(rid)["accepted_callbacks"] == 1
        assert states[running["rollout_id"]]["status"] == "error"
        assert len(trainer.recorded(running["rollout_id"])["calls"]) == 1, "the running rollout was not replayed"
        assert states[queued["rollout_id"]]["attempts"] == 1 and len(trainer.recorded(queued["rollout_id"])["calls"]) == 2
        finished_attempts = trainer.recorded(finished["rollout_id"])["callback_attempts"]
        assert [a["outcome"] for a in finished_attempts[attempts_before:]] == ["accepted"]
        assert {a["body"]["status"] for a in finished_attempts} == {"COMPLETED"}, "the stored body was resent"
