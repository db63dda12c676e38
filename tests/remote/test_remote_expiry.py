"""Settled remote rollouts (callback delivered, or refused for good) expire after `settled_ttl_s`: their state,
their index entry; unsettled ones never do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from rollout_buffer.remote.schema import InitRequest
from rollout_buffer.remote.state import RemoteStates
from rollout_buffer.store import keys
from rollout_buffer.store.store import Store
from tests.remote.test_remote_protocol import FAST_CALLBACKS, TASKS, delivered_state, init_body, start
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.recording_trainer import RecordingTrainer, run_recording_trainer_in_thread

TTL_S = 1.0
ENV = {**FAST_CALLBACKS, "ROLLOUT_BUFFER_REMOTE_SETTLED_TTL_S": str(TTL_S), "ROLLOUT_BUFFER_REMOTE_OWNER_TTL_S": "1"}


SERVER = ServerSpec(args=("--task-dir", TASKS, "--workers", "0"), env=ENV)


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def request(rollout_id: str) -> InitRequest:
    return InitRequest(rollout_id=rollout_id, server_url="http://127.0.0.1:9", messages=[{"role": "user", "content": "x"}],
                       tokenizer_name="t", task_type="remote_calculator")


async def test_settle_expires_the_state_and_prune_drops_only_expired_index_entries(redis_store: Store) -> None:
    states = RemoteStates(redis_store.redis)
    assert await states.claim(request("done"), "owner-a") and await states.claim(request("open"), "owner-a")
    await states.settle("done", 0.3)
    assert 0 < await redis_store.redis.pttl(keys.remote("done")) <= 300
    assert await redis_store.redis.zscore(keys.REMOTE_OPEN, "done") is None
    assert await redis_store.redis.pttl(keys.remote("open")) == -1, "an unsettled state never expires"
    deadline = time.monotonic() + 10
    while await redis_store.redis.exists(keys.remote("done")):
        assert time.monotonic() < deadline, "settled state did not expire"
        await asyncio.sleep(0.05)
    assert await states.prune_index(time.time() + 1) == 1
    assert await redis_store.redis.zscore(keys.REMOTE_INDEX, "done") is None
    assert await redis_store.redis.zscore(keys.REMOTE_INDEX, "open") is not None
    assert await states.prune_index(time.time() + 1) == 0


@pytest.fixture(scope="module")
def trainer() -> Iterator[RecordingTrainer]:
    with run_recording_trainer_in_thread(template="qwen2.5", seed=11, noise_tokens=(0, 0)) as recording:
        yield recording


def store_of(server: ServerProcess) -> redis.Redis:
    return redis.Redis(unix_socket_path=str((server.data_dir / "redis.sock").resolve()))


def gone(server: ServerProcess, rollout_id: str) -> bool:
    return httpx.get(f"{server.url}/init/{rollout_id}", timeout=30).status_code == 404


def test_delivered_rollout_expires_and_its_id_is_unknown_again(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer)
    start(server, body)
    assert trainer.wait_for_completion(body["rollout_id"])["status"] == "COMPLETED"
    state = delivered_state(server, body["rollout_id"])
    assert state["status"] == "completed"
    db = store_of(server)
    assert 0 < db.pttl(keys.remote(body["rollout_id"])) <= TTL_S * 1000
    wait_until(lambda: gone(server, body["rollout_id"]), "the state to expire")
    wait_until(lambda: db.zscore(keys.REMOTE_INDEX, body["rollout_id"]) is None, "the index entry to be pruned")
    assert db.zscore(keys.REMOTE_OPEN, body["rollout_id"]) is None
    again = httpx.post(f"{server.url}/init", json=body, timeout=30)
    assert again.status_code == 202 and again.json()["created"] is True, "after the TTL the id starts anew"
    wait_until(lambda: httpx.get(f"{server.url}/init/{body['rollout_id']}", timeout=30).json()["callback"]["status"]
               == "delivered", "the second run to settle")


def test_refused_callback_is_final_and_expires(server: ServerProcess, trainer: RecordingTrainer) -> None:
    trainer.fail_callbacks(1, "400")
    body = init_body(trainer, tools=False)
    start(server, body)
    state = wait_until(lambda: (s := httpx.get(f"{server.url}/init/{body['rollout_id']}", timeout=30).json())["callback"]["status"]
                       == "failed" and s, "the refusal to be recorded")
    assert "HTTP 400" in state["callback"]["last_error"] and state["callback"]["attempts"] == 1
    attempts = trainer.recorded(body["rollout_id"])["callback_attempts"]
    assert [a["outcome"] for a in attempts] == ["refused"], "a refusal is not retried"
    assert store_of(server).zscore(keys.REMOTE_OPEN, body["rollout_id"]) is None
    wait_until(lambda: gone(server, body["rollout_id"]), "the failed state to expire")


def test_unsettled_rollout_outlives_the_ttl(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, task_type="remote_faults", tools=False, metadata={"mode": "sleep", "sleep_s": 3 * TTL_S})
    start(server, body)
    trainer.wait_for_calls(body["rollout_id"], 1)
    time.sleep(2 * TTL_S)
    state = httpx.get(f"{server.url}/init/{body['rollout_id']}", timeout=30).json()
    assert state["status"] == "running", "a running rollout's state does not expire"
    assert store_of(server).zscore(keys.REMOTE_INDEX, body["rollout_id"]) is not None
    assert trainer.wait_for_completion(body["rollout_id"])["status"] == "COMPLETED"
    wait_until(lambda: gone(server, body["rollout_id"]), "the state to expire once settled")
