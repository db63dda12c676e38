"""Policy versions: what counts as one, a record's version, a read's staleness summary, and the engine
clients stamping every piece of a generation (an abort continued under a new policy version keeps both
versions, per token) against the test engine and a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from rollout_buffer.runtime.chat_client import ChatCompletionsClient
from rollout_buffer.runtime.engine_http import RetryPolicy, abort_all_requests, new_session
from rollout_buffer.runtime.policy_clock import PolicyClock
from rollout_buffer.runtime.sglang_client import GenerateClient
from rollout_buffer.security.outbound import ABORT_PATH
from rollout_buffer.store import keys
from rollout_buffer.store.store import Store
from rollout_buffer.testing.engine import running_engine
from rollout_buffer.wire.packing import pack_record, unpack_record
from rollout_buffer.wire.schema import TrajectoryRecord, Turn
from rollout_buffer.wire.versions import as_version, merge_spans, record_version, staleness_summary

USER = [{"role": "user", "content": "What is 20 + 22?"}]


def test_what_counts_as_a_version() -> None:
    assert [as_version(v) for v in (3, "3", " 12 ", 0)] == [3, 3, 12, 0]
    assert [as_version(v) for v in ("default", None, True, -1, "1.5", 2.0)] == [None] * 6


def test_a_records_version_is_its_oldest_turns() -> None:
    turns = [{"weight_version": 5}, {"weight_version": "default", "version_spans": [[4, 3], [6, 2]]}]
    assert record_version({"turns": turns}) == 4
    assert record_version({"turns": turns, "policy_version": 9}) == 9, "an explicit version wins"
    assert record_version({"weight_version": "7"}) == 7 and record_version({"weight_version": "default"}) is None
    packed = {"_turns": [{"weight_version": "3", "vs": [[3, 1], [2, 1]]}]}
    assert record_version(packed) == 2, "a packed header's turns count too"


def test_spans_merge_neighbours() -> None:
    assert merge_spans([(1, 2), (1, 3), (2, 0), (2, 4), (1, 1)]) == [[1, 5], [2, 4], [1, 1]]


def test_staleness_summary() -> None:
    summary, hist = staleness_summary(10, [10, 8, None, 7], bound=2)
    assert summary == {"min": 0, "mean": 5 / 3, "max": 3, "over_bound": 1}
    assert hist == Counter({0: 1, 2: 1, 3: 1})
    assert staleness_summary(None, [1, 2], 1)[0] == {"min": None, "mean": None, "max": None, "over_bound": 0}
    assert staleness_summary(4, [None], None)[0]["max"] is None


def test_version_spans_are_checked_and_survive_packing() -> None:
    turn = {"prompt_ids": [1, 2], "output_ids": [3, 4, 5], "output_logprobs": [-0.1] * 3, "finish_reason": "stop",
            "weight_version": 1, "version_spans": [[1, 2], [2, 1]]}
    with pytest.raises(ValueError, match="cover 2 tokens"):
        Turn.model_validate({**turn, "version_spans": [[1, 2]]})
    record = TrajectoryRecord.model_validate({"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0,
                                              "turns": [turn]}).to_store()
    back = unpack_record(pack_record(record))
    assert back["turns"][0]["version_spans"] == [[1, 2], [2, 1]]
    plain = unpack_record(pack_record({**record, "turns": [{**turn, "version_spans": None}]}))
    assert "version_spans" not in plain["turns"][0], "turns without spans keep their old shape"


async def _wait_in_flight(engine: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats_dict()["in_flight"] < 1:
        assert time.monotonic() < deadline, "the generation never reached the engine"
        await asyncio.sleep(0.01)


async def _run_meta(store: Store) -> str:
    run_id = f"v-{uuid.uuid4().hex[:8]}"
    await store.create_run(run_id, {}, group_size=1, num_epoch=1, task_type="t", extra_meta={"policy_version": 3})
    return run_id


async def test_an_abort_continued_under_a_new_version_keeps_both_per_token(redis_store: Store,
                                                                           qwen_tokenizer: Any) -> None:
    run_id = await _run_meta(redis_store)
    async with running_engine(template="qwen2.5", seed=5, latency_s=2.0) as engine:
        session = new_session()
        try:
            client = GenerateClient(session=session, engine=engine.url, tokenizer=qwen_tokenizer, tools=None,
                                    sampling_params={"max_new_tokens": 200}, policy=RetryPolicy(timeout_s=30),
                                    routing_key="r", clock=PolicyClock(redis_store.redis, run_id, ttl_s=0))
            call = asyncio.create_task(client.chat(USER))
            await _wait_in_flight(engine)
            await asyncio.sleep(1.0)  # half of the latency: the aborted piece has produced tokens
            await redis_store.set_policy_version(run_id, 4)
            await abort_all_requests(f"{engine.url}{ABORT_PATH}")
            await call
        finally:
            await session.close()
    turn = client.turns[0]
    assert turn["finish_reason"] == "stop" and engine.stats_dict()["aborts"] == 1
    spans = turn["version_spans"]
    assert [v for v, _ in spans] == [3, 4], "the piece before the abort under 3, the continuation under 4"
    assert sum(n for _, n in spans) == len(turn["output_ids"]) and all(n > 0 for _, n in spans)
    assert turn["weight_version"] == 3, "a turn's version is its oldest"
    assert client.versions == [3, 4]


async def test_a_numeric_engine_version_wins_over_the_runs(redis_store: Store, qwen_tokenizer: Any) -> None:
    run_id = await _run_meta(redis_store)
    async with running_engine(template="qwen2.5", seed=6, weight_version="7") as engine:
        session = new_session()
        try:
            clock = PolicyClock(redis_store.redis, run_id)
            client = GenerateClient(session=session, engine=engine.url, tokenizer=qwen_tokenizer, tools=None,
                                    sampling_params={"max_new_tokens": 64}, policy=RetryPolicy(timeout_s=30),
                                    routing_key="r", clock=clock)
            await client.chat(USER)
            engine.configure(weight_version="default")
            chat = ChatCompletionsClient(session=session, engine=engine.url, model="m", tools=None,
                                         sampling_params={"max_new_tokens": 64}, policy=RetryPolicy(timeout_s=30),
                                         routing_key="r2", clock=clock)
            await chat.chat(USER)
        finally:
            await session.close()
    assert client.turns[0]["weight_version"] == 7 and "version_spans" not in client.turns[0]
    assert chat.versions == [3], "'default' is no version: the run's policy version stands in"


async def test_without_a_policy_version_turns_keep_what_the_engine_said(qwen_tokenizer: Any) -> None:
    async with running_engine(template="qwen2.5", seed=6) as engine:
        session = new_session()
        try:
            client = GenerateClient(session=session, engine=engine.url, tokenizer=qwen_tokenizer, tools=None,
                                    sampling_params={"max_new_tokens": 64}, policy=RetryPolicy(timeout_s=30),
                                    routing_key="r")
            await client.chat(USER)
        finally:
            await session.close()
    assert client.turns[0]["weight_version"] == "default" and client.versions == []


async def test_the_clock_caches_for_its_ttl(redis_store: Store) -> None:
    run_id = await _run_meta(redis_store)
    clock = PolicyClock(redis_store.redis, run_id, ttl_s=3600)
    assert await clock.current() == 3
    await redis_store.redis.hset(keys.run_meta(run_id), "policy_version", 5)
    assert await clock.current() == 3, "cached"
    assert await clock.current(fresh=True) == 5, "read afresh (after an abort)"


async def test_a_new_version_is_announced_and_reaches_the_runs_clock(redis_store: Store) -> None:
    from types import SimpleNamespace

    from rollout_buffer.runtime.worker import WorkerPool
    from rollout_buffer.settings import Settings
    from rollout_buffer.tasks.discovery import TaskRegistry

    run_id = await _run_meta(redis_store)
    assert await redis_store.set_policy_version(run_id, 4) == (True, 3)
    assert await redis_store.set_policy_version(run_id, 4) == (True, 4)
    events = [{k.decode(): v.decode() for k, v in fields.items()}
              for _, fields in await redis_store.redis.xrange(keys.RUN_EVENTS)]
    assert events == [{"run_id": run_id, "policy_version": "4"}], "announced once: only a change is news"
    clock = PolicyClock(redis_store.redis, run_id, ttl_s=3600)
    assert await clock.current() == 4
    pool = WorkerPool(redis_store, TaskRegistry(), Settings())
    pool._runs[run_id] = [SimpleNamespace(handle=SimpleNamespace(clock=clock))]  # a run it serves
    pool._tasks[run_id] = asyncio.get_running_loop().create_future()
    pool.on_event(events[0] | {"policy_version": "9"})
    assert await clock.current() == 9, "pushed: no Redis read"
    assert await redis_store.set_policy_version("no-such-run", 1) == (False, None)
