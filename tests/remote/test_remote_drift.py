"""Remote rollouts against a faithful trainer peer: every call's response_mask must equal the trainer's own
count by the protocol's formula on the messages it received, drift between the model's ids and the
re-rendered history is reported (GET /init, the callback's metadata, /metrics), and calls with no count a
trainer could accept end the rollout with an ERROR callback instead of being sent."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.remote.test_remote_protocol import FAST_CALLBACKS, TASKS, delivered_state, init_body, start
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.recording_trainer import RecordingTrainer, run_recording_trainer_in_thread

# The scripted model: first two calculator calls in compact JSON (keys in either order) with whitespace at the
# reply's edges, then one call spelled as the template spells it, then the answer.
TWO_CALLS = ('\n <tool_call>\n{"arguments":{"expression":"17*23"},"name":"calculator"}\n</tool_call>\n'
             '<tool_call>\n{"name":"calculator","arguments":{"expression":"23*17"}}\n</tool_call>\n ')
ONE_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "391 - 0"}}\n</tool_call>'
ANSWER = " The answer is \\boxed{391}.\n"
USER = "<|im_start|>user\n"


SERVER = ServerSpec(args=("--task-dir", TASKS, "--workers", "0"), env=FAST_CALLBACKS)


def scripted_model(prompt_text: str, rng: random.Random) -> str:
    """Answer by how many tool results follow the last real user query."""
    turns = prompt_text.split(USER)
    results = 0
    for turn in reversed(turns[1:]):
        if not turn.startswith("<tool_response>"):
            break
        results += turn.count("<tool_response>")
    return TWO_CALLS if results == 0 else ONE_CALL if results == 2 else ANSWER


@pytest.fixture(scope="module")
def scripted(server: ServerProcess) -> Iterator[RecordingTrainer]:
    with run_recording_trainer_in_thread(template="qwen2.5", seed=5, responder=scripted_model,
                                         noise_tokens=(0, 0)) as trainer:
        yield trainer


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not on /metrics")


def check_masks_against_the_formula(rec: dict[str, Any]) -> list[int]:
    """Every later call's mask is the formula's count, recomputed here from what the trainer rendered and
    returned; returns the calls whose render does not start with what the trainer held (drift)."""
    assert rec["errors"] == [], rec["errors"]
    calls = rec["calls"]
    assert calls[0]["response_mask"] is None
    drifted = []
    for k in range(1, len(calls)):
        previous, call = calls[k - 1], calls[k]
        held = previous["rendered_ids"] + previous["output_ids"]
        n = len(call["rendered_ids"]) - len(held)
        assert call["response_mask"] == [0] * n and call["expected_new_tokens"] == n, f"call {k}"
        assert call["new_token_ids"] == call["rendered_ids"][len(call["rendered_ids"]) - n:]
        if call["rendered_ids"][:len(held)] != held:
            drifted.append(k)
    last = calls[-1]
    assert len(rec["prompt_ids"]) + len(rec["response_ids"]) == len(last["rendered_ids"]) + len(last["output_ids"])
    expected_ids = list(calls[0]["output_ids"])
    expected_mask = [1] * len(calls[0]["output_ids"])
    for call in calls[1:]:
        expected_ids += call["new_token_ids"] + call["output_ids"]
        expected_mask += [0] * len(call["new_token_ids"]) + [1] * len(call["output_ids"])
    assert rec["response_ids"] == expected_ids and rec["response_mask"] == expected_mask
    return drifted


def test_tool_loop_masks_match_the_trainers_count_and_drift_is_reported(
        server: ServerProcess, scripted: RecordingTrainer) -> None:
    before = {region: metric(server, "rollout_buffer_remote_masks_total", drift=region)
              for region in ("none", "assistant")}
    tokens_before = metric(server, "rollout_buffer_remote_mask_drift_tokens_total")
    body = init_body(scripted, messages=[{"role": "user", "content": "  What is 17 * 23?\n"}])
    start(server, body)
    done = scripted.wait_for_completion(body["rollout_id"])
    assert done["status"] == "COMPLETED" and done["reward"] == 1.0
    replies = [m for m in done["messages"] if m["role"] == "assistant"]
    assert [len(m.get("tool_calls") or []) for m in replies] == [2, 1, 0]
    assert all(isinstance(c["function"]["arguments"], str) for m in replies for c in m.get("tool_calls") or [])
    rec = scripted.recorded(body["rollout_id"])
    drifted = check_masks_against_the_formula(rec)
    assert drifted == [1], "the compact two-call reply re-renders differently; the canonical one does not"
    call = rec["calls"][1]
    assert call["tail_ids"] is not None and len(call["tail_ids"]) != call["expected_new_tokens"]

    state = delivered_state(server, body["rollout_id"])
    mask = state["mask"]
    assert mask["counted_calls"] == 2 and mask["drift_calls"] == len(drifted) and mask["drift_tokens"] > 0
    first = mask["first_drift"]
    assert first["call_index"] == 1 and first["region"] == "assistant"
    assert first["offset"] == call["expected_new_tokens"] - len(call["tail_ids"])
    assert '"arguments":{"expression":"17*23"}' in first["held_text"]
    assert done["metadata"]["rollout_buffer"]["mask"] == mask, "the trainer gets the same report"
    assert metric(server, "rollout_buffer_remote_masks_total", drift="assistant") == before["assistant"] + 1
    assert metric(server, "rollout_buffer_remote_masks_total", drift="none") == before["none"] + 1
    assert metric(server, "rollout_buffer_remote_mask_drift_tokens_total") == tokens_before + mask["drift_tokens"]


def test_noisy_model_ids_drift_and_each_mask_still_follows_the_formula(server: ServerProcess) -> None:
    """The test engine's noise tokens do not survive decode -> encode (real BPE merges), so re-rendered
    replies have other ids and other lengths. Fixed rollout ids make the sampled ids, and so this test,
    deterministic."""
    with run_recording_trainer_in_thread(template="qwen2.5", seed=7) as trainer:
        bodies = [init_body(trainer, rollout_id=f"noisy-{i}") for i in range(4)]
        for body in bodies:
            start(server, body)
        done = [trainer.wait_for_completion(body["rollout_id"]) for body in bodies]
        recs = [trainer.recorded(body["rollout_id"]) for body in bodies]
    assert {d["status"] for d in done} == {"COMPLETED"}
    offsets = []
    for body, rec in zip(bodies, recs):
        drifted = check_masks_against_the_formula(rec)
        mask = delivered_state(server, body["rollout_id"])["mask"]
        assert mask["counted_calls"] == len(rec["calls"]) - 1 and mask["drift_calls"] == len(drifted)
        if drifted:
            call = rec["calls"][drifted[0]]
            assert mask["first_drift"]["call_index"] == drifted[0]
            assert mask["first_drift"]["offset"] == call["expected_new_tokens"] - len(call["tail_ids"])
            offsets.append(mask["first_drift"]["offset"])
            if mask["first_drift"]["offset"]:  # the trainer's context after the reply is off by that much
                assert call["new_token_ids"] != call["tail_ids"]
    assert offsets and any(offsets), "the noise must make re-rendered replies drift, in length too"


def test_exact_rerender_reports_no_drift_with_choice_level_token_ids(server: ServerProcess) -> None:
    with run_recording_trainer_in_thread(template="qwen2.5", seed=9, noise_tokens=(0, 0),
                                         token_ids_at="choice") as trainer:
        body = init_body(trainer)
        start(server, body)
        done = trainer.wait_for_completion(body["rollout_id"])
        assert done["status"] == "COMPLETED" and done["reward"] == 1.0
        rec = trainer.recorded(body["rollout_id"])
    assert len(rec["calls"]) == 2 and check_masks_against_the_formula(rec) == []
    assert rec["calls"][1]["new_token_ids"] == rec["calls"][1]["tail_ids"], "no drift: the formula is the tail"
    mask = delivered_state(server, body["rollout_id"])["mask"]
    assert mask == {"counted_calls": 1, "drift_calls": 0, "drift_tokens": 0, "first_drift": None}


def test_negative_count_ends_the_rollout_with_an_error_callback(server: ServerProcess, qwen3_tokenizer: Any) -> None:
    """Qwen3 drops an earlier turn's reasoning once a new user turn follows: the render is shorter than what
    the trainer holds, so no mask exists; the call is not sent and the trainer gets the reason."""
    refused = metric(server, "rollout_buffer_remote_mask_refused_total", reason="negative_count")
    follow_up = "Thanks."
    with run_recording_trainer_in_thread(template="qwen3", seed=3, noise_tokens=(60, 60)) as trainer:
        body = init_body(trainer, task_type="remote_faults", tools=False,
                         tokenizer_name=str(qwen_tokenizer_dir("qwen3")),
                         metadata={"mode": "follow_up", "follow_up": follow_up})
        start(server, body)
        done = trainer.wait_for_completion(body["rollout_id"])
        rec = trainer.recorded(body["rollout_id"])
    assert done["status"] == "ERROR" and done["error"].startswith("MaskCountError: response_mask count is -")
    assert len(rec["calls"]) == 1 and rec["errors"] == [], "the call without a valid count was never sent"
    first = rec["calls"][0]
    messages = [*done["messages"], {"role": "user", "content": follow_up}]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    render = qwen3_tokenizer.encode(qwen3_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True),
                                    add_special_tokens=False)
    n = len(render) - (len(first["rendered_ids"]) + len(first["output_ids"]))
    assert n < 0 and f"response_mask count is {n}:" in done["error"], "the trainer's formula agrees"
    assert done["metadata"]["rollout_buffer"]["mask"]["counted_calls"] == 0
    state = delivered_state(server, body["rollout_id"])
    assert state["status"] == "error" and "MaskCountError" in state["error"]
    assert metric(server, "rollout_buffer_remote_mask_refused_total", reason="negative_count") == refused + 1


def test_answer_without_token_ids_ends_the_rollout_with_an_error_callback(
        server: ServerProcess, scripted: RecordingTrainer) -> None:
    refused = metric(server, "rollout_buffer_remote_mask_refused_total", reason="no_token_ids")
    body = init_body(scripted)
    scripted.omit_token_ids(body["rollout_id"])
    start(server, body)
    done = scripted.wait_for_completion(body["rollout_id"])
    assert done["status"] == "ERROR" and "MaskCountError" in done["error"] and "token_ids" in done["error"]
    assert len(scripted.recorded(body["rollout_id"])["calls"]) == 1
    assert delivered_state(server, body["rollout_id"])["counts"]["turns"] == 0
    assert metric(server, "rollout_buffer_remote_mask_refused_total", reason="no_token_ids") == refused + 1
