"""The agent gateway with the real OpenAI SDK: tool loops (plain and streamed) through a real server and
the test engine; records are the engine's exact ids, grouped, read and built by the adapter."""

from __future__ import annotations

import asyncio

from typing import Any

import httpx
import openai
import pytest

from slime_adapter.reading.buffer_client import ack_batches, fetch_rollout_data
from slime_adapter.samples.build import build_group_samples
from tests.support.backends import CLUSTER_BACKENDS
from tests.support.gateway import (
    CALCULATOR,
    assert_one_branch,
    assert_turns_are_engine_calls,
    engine_calls_of,
    finish,
    new_session,
    openai_tool_loop,
    start_external,
)
from tests.support.helpers import ServerSpec

QUESTIONS = ["What is 17 * 3 + 4?", "And what is (2 + 9) * 7?"]


SERVER = ServerSpec(args=("--session-timeout-s", "60"), backends=tuple(CLUSTER_BACKENDS))  # embedded and cluster



@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_tool_loops_make_token_exact_grouped_records(client: httpx.Client, rollout_engine: Any,
                                                            qwen_tokenizer_path: str, stream: bool) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=2)
    sessions = []
    for reward in (1.0, 0.0):
        session = new_session(client, run_id, "q-17")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        messages = openai_tool_loop(sdk, QUESTIONS, stream=stream)
        assert sum(1 for m in messages if m["role"] == "assistant") >= 4, messages
        assert messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
        assert "51" in messages[3]["content"] or "\\boxed" in messages[3]["content"]
        sessions.append((session, messages))
        answer = finish(client, session, reward)
        assert answer["outcome"] in ("stored", "completed")
    assert answer["group_completed"] is True
    # read as the trainer reads: the adapter's client, packed answer, leased and acknowledged
    records, meta, _ = asyncio.run(fetch_rollout_data(str(client.base_url), run_id=run_id, lease_s=60,
                                                      wait_s=10, read_format="packed"))
    assert len(records) == 2 and meta["finished_groups"] == ["q-17"]
    asyncio.run(ack_batches(str(client.base_url), [meta["batch_id"]], run_id=run_id))
    by_uid = {r["uid"]: r for r in records}
    for session, messages in sessions:
        record = by_uid[session["session_id"]]
        assert record["instance_id"] == "q-17" and record["epoch"] == 0
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
        assert_one_branch(record)
        assert len(record["turns"]) == sum(1 for m in messages if m["role"] == "assistant")
        assert record["tools"] == [CALCULATOR]
        assert [m["role"] for m in record["messages"]] == [m["role"] for m in messages]
    samples, stats = build_group_samples(records, lambda: pytest.fail("the token path needs no tokenizer"))
    assert stats.token_path_records == 2 and stats.forks == 0 and len(samples) == 2
    for sample, record in zip(samples, records):
        turns = record["turns"]
        assert sample.tokens == list(turns[-1]["prompt_ids"]) + list(turns[-1]["output_ids"])
        assert sum(sample.loss_mask) == sum(len(t["output_ids"]) for t in turns)


def test_plain_answer_shape_and_usage(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "shape")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    completion = sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is 2 + 2?"}])
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and choice.finish_reason == "stop"
    assert "\\boxed{" in choice.message.content and not choice.message.tool_calls
    [call] = engine_calls_of(rollout_engine, session["session_id"])
    assert completion.usage.prompt_tokens == len(call["prompt_ids"])
    assert completion.usage.completion_tokens == len(call["output_ids"])
    cut = sdk.chat.completions.create(model="policy", max_tokens=3,
                                      messages=[{"role": "user", "content": "What is 5 + 5?"}])
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["default"]
