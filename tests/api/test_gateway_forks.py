"""A client that changes history forks its session: a new branch, counted per reason, each branch its own
piece for the adapter; a session's own answers are never re-tokenized."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import openai
import pytest

from slime_adapter.hooks.metrics import rollout_metrics
from slime_adapter.samples.build import build_samples
from tests.support.gateway import (
    CALCULATOR,
    assert_turns_are_engine_calls,
    engine_calls_of,
    finish,
    new_session,
    openai_tool_loop,
    start_external,
)
from tests.support.helpers import ServerSpec


SERVER = ServerSpec(args=("--session-timeout-s", "60"))



def ask(sdk: openai.OpenAI, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Any:
    kwargs = {"tools": tools} if tools else {}
    return sdk.chat.completions.create(model="m", messages=messages, **kwargs).choices[0].message


def test_each_history_change_forks_once_per_reason(client: httpx.Client, rollout_engine: Any,
                                                   qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "forky")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    history = openai_tool_loop(sdk, ["What is 4 * 9?"])  # 2 turns, one branch
    assert len(history) == 4
    edited = copy.deepcopy(history)
    edited[0]["content"] = "What is 4 * 10?"
    openai_tool_loop_next = [*edited, {"role": "user", "content": "Thanks. And 3 + 3?"}]
    ask(sdk, openai_tool_loop_next, [CALCULATOR])  # edited: a user message before our answers changed
    foreign = [*history, {"role": "user", "content": "Check: 1 + 1?"}, {"role": "assistant", "content": "It is 2."},
               {"role": "user", "content": "And 2 + 5?"}]
    ask(sdk, foreign, [CALCULATOR])  # an assistant message the session did not generate
    compacted = [{"role": "user", "content": "Summary: 4 * 9 = 36. What is 36 + 1?"}]
    ask(sdk, compacted, [CALCULATOR])  # history replaced by a summary
    ask(sdk, [*history, {"role": "user", "content": "What is 8 - 3?"}])  # the same history, tools dropped
    rewind = [*history[:2], {"role": "tool", "tool_call_id": history[1]["tool_calls"][0]["id"], "content": "37"}]
    ask(sdk, rewind, [CALCULATOR])  # goes on from the first turn again (a different tool result)
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    forks = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("gateway_forks:")}
    assert forks == {"edited": 1, "foreign_assistant": 1, "compacted": 1, "tools_changed": 1, "rewind": 1}, stats
    assert stats["gateway_forks"] == 5 and stats["gateway_turns"] == 7
    detail = client.get("/api/dashboard", params={"run_id": run_id}).json()["run"]["gateway"]
    assert detail["sessions_open"] == 1 and detail["turns"] == 7 and detail["forks"] == 5
    assert detail["forks_by_reason"] == forks
    exposition = client.get("/metrics").text
    assert f'rollout_buffer_gateway_forks_total{{reason="rewind",run_id="{run_id}"}} 1.0' in exposition
    assert f'rollout_buffer_gateway_sessions_open{{run_id="{run_id}"}} 1.0' in exposition
    finish(client, session, 1.0)
    answer = client.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 10}).json()
    [record] = answer["data"]["data"]
    assert answer["data"]["meta_info"]["gateway_forks"] == forks
    logged = rollout_metrics([answer["data"]["meta_info"]])
    assert logged["rollout/gateway_forks"] == 5 and logged["rollout/gateway_forks/compacted"] == 1
    assert client.get("/api/dashboard", params={"run_id": run_id}).json()["run"]["gateway"]["sessions_open"] == 0
    assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
    assert record["extra_info"]["gateway_forks"] == 5
    turns = record["turns"]
    # the rewind extends turn 0 token for token: its stored ids are reused, not re-tokenized
    head = list(turns[0]["prompt_ids"]) + list(turns[0]["output_ids"])
    assert list(turns[6]["prompt_ids"][:len(head)]) == head
    samples, stats_all = build_samples(record, lambda: pytest.fail("token path"), fork_policy="all")
    assert stats_all.forks == 5 and len(samples) == 6, "each branch is its own piece"
    last, stats_last = build_samples(record, lambda: pytest.fail("token path"), fork_policy="last")
    assert len(last) == 1 and stats_last.fork_dropped_pieces == 5
    assert last[0].tokens == list(turns[6]["prompt_ids"]) + list(turns[6]["output_ids"])


def test_echoed_answers_match_whatever_the_sdk_sends_back(client: httpx.Client, rollout_engine: Any,
                                                          qwen_tokenizer_path: str) -> None:
    """An echo with the content as a list of text parts, ids changed and arguments re-serialised is still
    the session's own answer: no fork."""
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
    session = new_session(client, run_id, "echo")
    sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 9 * 9?"}]
    answer = ask(sdk, messages, [CALCULATOR])
    call = answer.tool_calls[0]
    parts = [{"type": "text", "text": answer.content}] if answer.content else None
    messages.append({"role": "assistant", "content": parts, "tool_calls": [{
        "id": "my-own-id", "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments.replace(": ", ":")}}]})
    messages.append({"role": "tool", "tool_call_id": "my-own-id", "content": "81"})
    ask(sdk, messages, [CALCULATOR])
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert stats["gateway_turns"] == 2 and "gateway_forks" not in stats
