"""Remote-rollout protocol end to end: a real buffer server process (on the embedded Redis and on a real
3-node Redis Cluster) drives test task modules against a recording trainer (its own TestEngine behind it)
over loopback HTTP, with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.fixtures.remote_tasks.remote_calculator_generator import TOOLS
from tests.support.backends import CLUSTER_BACKENDS, shared_redis_args
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.recording_trainer import RecordingTrainer, run_recording_trainer_in_thread

TASKS = str(Path(__file__).parents[1] / "fixtures" / "remote_tasks")
FAST_CALLBACKS = {"ROLLOUT_BUFFER_REMOTE_CALLBACK_BACKOFF_S": "0.05",
                  "ROLLOUT_BUFFER_REMOTE_CALLBACK_MAX_BACKOFF_S": "0.2"}


SERVER = ServerSpec(args=("--task-dir", TASKS, "--workers", "0"), env=FAST_CALLBACKS,
                    backends=tuple(CLUSTER_BACKENDS))


@pytest.fixture(scope="module")
def trainer() -> Iterator[RecordingTrainer]:
    """A model without noise tokens: its ids survive the re-rendering, so every rollout here runs the same
    turns (drift, and what it does to the trainer's context, is tested in test_remote_drift)."""
    with run_recording_trainer_in_thread(template="qwen2.5", seed=7, noise_tokens=(0, 0)) as recording:
        yield recording


def init_body(trainer: RecordingTrainer, *, task_type: str = "remote_calculator", tools: bool = True,
              question: str = "What is 17 * 23?", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rollout_id": f"r-{uuid.uuid4().hex[:12]}", "server_url": trainer.url,
        "messages": [{"role": "user", "content": question}],
        "tokenizer_name": str(qwen_tokenizer_dir("qwen2.5")),
        "sampling_params": {"max_new_tokens": 256, "temperature": 1.0}, "task_type": task_type,
        "metadata": {"answer": "391"},
    }
    if tools:
        body["tools"] = TOOLS
    body.update(extra)
    return body


def delivered_state(server: ServerProcess, rollout_id: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """GET /init/{id} once the buffer has recorded its callback as delivered."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{server.url}/init/{rollout_id}", timeout=30).json()
        if state["callback"]["delivered"]:
            return state
        assert time.monotonic() < deadline, f"callback of {rollout_id} not recorded as delivered: {state}"
        time.sleep(0.05)


def start(server: ServerProcess, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.url}/init", json=body, timeout=30)
    assert response.status_code == 202, response.text
    assert response.json()["created"] is True and response.json()["status"] in ("queued", "running")


def test_single_turn_sends_no_mask_and_every_response_token_is_the_models(
        server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, tools=False)
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "COMPLETED" and done["metadata"]["answer"] == "391"
    rec = httpx.get(f"{trainer.url}/_recorded/{body['rollout_id']}", timeout=30).json()  # the trainer's HTTP view
    assert rec["errors"] == []
    (call,) = rec["calls"]
    assert call["response_mask"] is None, "the first call carries no mask"
    assert rec["response_ids"] == call["output_ids"] and rec["response_mask"] == [1] * len(call["output_ids"])
    assert done["messages"][-1]["role"] == "assistant" and "boxed" in done["messages"][-1]["content"]
    state = delivered_state(server, body["rollout_id"])
    assert state["status"] == "completed" and state["counts"]["engine_calls"] == 1 and state["counts"]["turns"] == 1
    assert state["attempts"] == 1 and state["callback"]["attempts"] == 1


def test_tool_turns_send_the_protocols_count_of_zeros(
        server: ServerProcess, trainer: RecordingTrainer, qwen_tokenizer: Any) -> None:
    body = init_body(trainer)
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "COMPLETED" and done["reward"] == 1.0
    roles = [m["role"] for m in done["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    rec = trainer.recorded(body["rollout_id"])
    assert rec["errors"] == []
    first, second = rec["calls"]
    tool = done["messages"][2]
    # The guide's count, from the renders of the messages as sent and the model's token_ids ...
    n = len(second["rendered_ids"]) - len(first["rendered_ids"]) - len(first["output_ids"])
    assert second["response_mask"] == [0] * n and second["expected_new_tokens"] == n
    # ... is, without drift, the Qwen2.5 template's text after the reply, spelled out here by hand.
    added = qwen_tokenizer.encode("\n<|im_start|>user\n<tool_response>\n" + tool["content"] +
                                  "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert second["new_token_ids"] == second["tail_ids"] == added
    assert delivered_state(server, body["rollout_id"])["mask"] == {
        "counted_calls": 1, "drift_calls": 0, "drift_tokens": 0, "first_drift": None}
    out1, out2 = first["output_ids"], second["output_ids"]
    assert rec["response_mask"] == [1] * len(out1) + [0] * n + [1] * len(out2)
    assert len(rec["response_ids"]) == len(rec["response_mask"])
    assert rec["response_ids"] == out1 + second["new_token_ids"] + out2
    assert second["prompt_ids"] == rec["prompt_ids"] + out1 + second["new_token_ids"], "generated from its own tokens"


def test_init_is_idempotent_by_rollout_id(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer)
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(f"{server.url}/init", json=body, timeout=10))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(a.status_code for a in answers) == [200] * 5 + [202]
    assert [a.json()["created"] for a in answers].count(True) == 1
    trainer.wait_for_completion(body["rollout_id"])
    state = delivered_state(server, body["rollout_id"])
    again = httpx.post(f"{server.url}/init", json=body, timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "completed" and again.json()["request_matches"]
    changed = httpx.post(f"{server.url}/init", json={**body, "metadata": {"answer": "0"}}, timeout=30)
    assert changed.status_code == 200 and changed.json()["request_matches"] is False
    rec = trainer.recorded(body["rollout_id"])
    assert [c["call_index"] for c in rec["calls"]] == [0, 1], "one rollout: one set of calls"
    assert state["attempts"] == 1 and rec["accepted_callbacks"] == 1


def test_two_api_processes_claim_a_rollout_id_once(server: ServerProcess, trainer: RecordingTrainer,
                                                  tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "b", "--task-dir", TASKS, "--workers", "0", *shared_redis_args(server),
                       env=FAST_CALLBACKS) as other:
        body = init_body(trainer)
        urls = [server.url, other.url] * 4
        barrier = threading.Barrier(len(urls))
        answers: list[httpx.Response] = []

        def post(url: str) -> None:
            barrier.wait(timeout=10)
            answers.append(httpx.post(f"{url}/init", json=body, timeout=10))

        threads = [threading.Thread(target=post, args=(url,)) for url in urls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert sorted(a.status_code for a in answers) == [200] * 7 + [202]
        trainer.wait_for_completion(body["rollout_id"])
        assert delivered_state(other, body["rollout_id"])["attempts"] == 1, "either process shows the state"
        assert [c["call_index"] for c in trainer.recorded(body["rollout_id"])["calls"]] == [0, 1]


def test_callback_arrives_once_despite_dropped_connections_and_500s(
        server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, tools=False)
    trainer.fail_callbacks(2, "drop")
    trainer.fail_callbacks(1, "500")
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "COMPLETED"
    state = delivered_state(server, body["rollout_id"])
    time.sleep(0.5)  # room for a wrong resend to show up
    rec = trainer.recorded(body["rollout_id"])
    assert [a["outcome"] for a in rec["callback_attempts"]] == ["dropped", "dropped", "fail_500", "accepted"]
    assert {a["idempotency_key"] for a in rec["callback_attempts"]} == {body["rollout_id"]}
    assert state["callback"]["attempts"] == 4


def test_task_exception_yields_exactly_one_error_callback(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, task_type="remote_faults", tools=False, metadata={"mode": "raise"})
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "ERROR" and "RuntimeError: task exploded on purpose" in done["error"]
    assert [m["role"] for m in done["messages"]] == ["user", "assistant"], "the conversation so far"
    state = delivered_state(server, body["rollout_id"])
    assert state["status"] == "error" and "task exploded" in state["error"]
    time.sleep(0.3)
    assert trainer.recorded(body["rollout_id"])["accepted_callbacks"] == 1
    assert len(trainer.recorded(body["rollout_id"])["callback_attempts"]) == 1


def test_history_rewrite_is_refused_not_masked(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, task_type="remote_faults", tools=False, metadata={"mode": "rewrite"})
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "ERROR" and done["error"].startswith("HistoryRewriteError")
    assert "append-only" in done["error"]
    rec = trainer.recorded(body["rollout_id"])
    assert len(rec["calls"]) == 1 and rec["errors"] == [], "the rewritten call never reached the trainer"


def test_explicit_mask_is_sent_verbatim(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, task_type="remote_faults", tools=False,
                     metadata={"mode": "rewrite_with_mask", "mask_len": 7})
    trainer.allow_unchecked_mask(body["rollout_id"])
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"])
    assert done["status"] == "COMPLETED"
    calls = trainer.recorded(body["rollout_id"])["calls"]
    assert [c["response_mask"] for c in calls] == [None, [0] * 7]


def test_timeout_yields_error_callback(server: ServerProcess, trainer: RecordingTrainer) -> None:
    body = init_body(trainer, task_type="remote_faults", tools=False, timeout_s=0.5,
                     metadata={"mode": "sleep", "sleep_s": 30})
    start(server, body)
    done = trainer.wait_for_completion(body["rollout_id"], timeout_s=15)
    assert done["status"] == "ERROR" and "timed out after 0.5s" in done["error"]


@pytest.mark.parametrize(("change", "field"), [
    ({"server_url": None}, "server_url"),
    ({"server_url": "ftp://x"}, "server_url"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"rollout_id": "index"}, "rollout_id"),
    ({"tokenizer_name": ""}, "tokenizer_name"),
    ({"task_type": "no_such_task"}, "task_type"),
])
def test_invalid_init_bodies_name_the_field(server: ServerProcess, trainer: RecordingTrainer,
                                            change: dict[str, Any], field: str) -> None:
    body = {**init_body(trainer), **change}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{server.url}/init", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert any(e["field"].split(".")[0] == field for e in response.json()["errors"]), response.text
    if body.get("rollout_id") not in (None, "index"):
        answer = httpx.get(f"{server.url}/init/{body['rollout_id']}", timeout=30)
        assert answer.status_code == 404, "nothing was started"


def test_unknown_rollout_id_is_404(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/init/never-seen", timeout=30)
    assert response.status_code == 404 and "never-seen" in response.json()["message"]
