"""The SGLang test engine over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_buffer.testing.engine import TestEngine, run_engine_in_thread, running_engine
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

IM_END = 151645
QUESTION = "What is 12 + 7 * 3?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        raw = await resp.read()
        return resp.status, (json.loads(raw) if raw else None)


def prompt_ids(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs)


@pytest.fixture
async def engine() -> AsyncIterator[TestEngine]:
    async with running_engine(template="qwen2.5") as eng:
        yield eng


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def generate(session: aiohttp.ClientSession, eng: TestEngine, ids: list[int], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "return_logprob": True, **extra}
    status, data = await post(session, eng.url + "/generate", body)
    assert status == 200, data
    return data


async def test_generate_shape_stops_at_im_end(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    out = await generate(session, engine, ids, rid="req-1", sampling_params={"max_new_tokens": 256})
    meta = out["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert out["output_ids"][-1] == IM_END and IM_END not in out["output_ids"][:-1]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["weight_version"] == "default"
    logprobs = meta["output_token_logprobs"]
    assert len(logprobs) == len(out["output_ids"])
    assert [t for _, t, _ in logprobs] == out["output_ids"]
    assert all(lp < 0 and extra is None for lp, _, extra in logprobs)
    assert "<|im_end|>" not in out["text"]
    assert out["text"] == qwen_tokenizer.decode(out["output_ids"][:-1], skip_special_tokens=True)
    assert "\\boxed{" in out["text"]
    without = await generate(session, engine, ids, rid="req-1", return_logprob=False)
    assert "output_token_logprobs" not in without["meta_info"]
    assert without["output_ids"] == out["output_ids"]


async def test_special_token_text_options(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    kept = await generate(
        session, engine, ids, rid="a", sampling_params={"skip_special_tokens": False, "no_stop_trim": True}
    )
    assert kept["text"].endswith("<|im_end|>")
    trimmed = await generate(session, engine, ids, rid="a", sampling_params={"skip_special_tokens": False})
    assert trimmed["output_ids"] == kept["output_ids"]
    assert trimmed["text"] + "<|im_end|>" == kept["text"]


async def test_length_cut_is_exact(engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    full = await generate(session, engine, ids, rid="x")
    cut = await generate(session, engine, ids, rid="x", sampling_params={"max_new_tokens": 5})
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert cut["output_ids"] == full["output_ids"][:5]
    assert len(cut["meta_info"]["output_token_logprobs"]) == 5
    assert cut["text"] == qwen_tokenizer.decode(cut["output_ids"], skip_special_tokens=True)
    exact = len(full["output_ids"])
    at_eos = await generate(session, engine, ids, rid="x", sampling_params={"max_new_tokens": exact})
    assert at_eos["meta_info"]["finish_reason"] == {"type": "length", "length": exact}


async def test_stop_strings_and_stop_token_ids(session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    async with running_engine(noise_tokens=(0, 0), p_correct=1.0) as eng:
        ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
        by_str = await generate(session, eng, ids, sampling_params={"stop": ["boxed"]})
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": "boxed"}
        assert by_str["text"] == "The answer is \\"
        full = await generate(session, eng, ids, sampling_params={"temperature": 0})
        stop_id = full["output_ids"][2]
        by_id = await generate(session, eng, ids, sampling_params={"stop_token_ids": [stop_id], "temperature": 0})
        assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        assert by_id["output_ids"] == full["output_ids"][:3]
        assert by_id["text"] == qwen_tokenizer.decode(full["output_ids"][:2])


async def test_text_and_batched_inputs(engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    status, single = await post(session, engine.url + "/generate", {"text": "Compute 2 + 2.", "rid": "t"})
    assert status == 200
    assert single["meta_info"]["prompt_tokens"] == len(qwen_tokenizer.encode("Compute 2 + 2."))
    assert single["text"].endswith("\\boxed{4}") or "\\boxed{" in single["text"]
    status, batch = await post(
        session, engine.url + "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["b0", "b1"]}
    )
    assert status == 200 and [b["meta_info"]["id"] for b in batch] == ["b0", "b1"]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]
    status, error = await post(session, engine.url + "/generate", {"sampling_params": {}})
    assert status == 400 and "input_ids" in error["error"]["message"]
    status, error = await post(session, engine.url + "/generate", {"input_ids": [10**9]})
    assert status == 400


async def test_tool_call_then_answer(engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = await generate(session, engine, prompt_ids(qwen_tokenizer, messages, tools=TOOLS), rid="t1")
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}}\n</tool_call>'
    assert first["text"].endswith(call_text)
    assert 151657 in first["output_ids"] and 151658 in first["output_ids"]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "33"},
    ]
    second = await generate(session, engine, prompt_ids(qwen_tokenizer, messages, tools=TOOLS), rid="t2")
    assert second["text"].endswith("The answer is \\boxed{33}")
    assert "<tool_call>" not in second["text"]


async def test_outputs_include_tokens_that_do_not_round_trip(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    outs = await asyncio.gather(*(generate(session, engine, ids, rid=f"r{i}") for i in range(20)))
    drifted = 0
    for out in outs:
        text = qwen_tokenizer.decode(out["output_ids"])
        if qwen_tokenizer.encode(text, add_special_tokens=False) != out["output_ids"]:
            drifted += 1
    assert drifted >= 14
    async with running_engine(noise_tokens=(0, 0)) as clean:
        for i in range(5):
            out = await generate(session, clean, ids, rid=f"c{i}")
            text = qwen_tokenizer.decode(out["output_ids"])
            assert qwen_tokenizer.encode(text, add_special_tokens=False) == out["output_ids"]


async def test_p_correct_controls_answers(session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    for p_correct, expected in ((1.0, True), (0.0, False)):
        async with running_engine(p_correct=p_correct) as eng:
            for i in range(5):
                out = await generate(session, eng, ids, rid=f"p{i}")
                assert out["text"].endswith("\\boxed{33}") is expected


async def test_chat_completions_tool_calls_and_token_ids(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    body = {"model": "m", "messages": messages, "tools": TOOLS, "return_token_ids": True, "logprobs": True, "rid": "c1"}
    status, data = await post(session, engine.url + "/v1/chat/completions", body)
    assert status == 200, data
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "12 + 7 * 3"}
    assert data["prompt_token_ids"] == prompt_ids(qwen_tokenizer, messages, tools=TOOLS)
    assert choice["prompt_token_ids"] == data["prompt_token_ids"]
    assert choice["token_ids"][-1] == IM_END
    assert data["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert data["metadata"]["weight_version"] == "default"

    # Second turn: arguments as a JSON string, as OpenAI clients send them back.
    call["function"]["arguments"] = '{"expression":"12 + 7 * 3"}'
    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "33"}]
    status, data = await post(session, engine.url + "/v1/chat/completions", {**body, "messages": messages, "rid": "c2"})
    assert status == 200
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"].endswith("The answer is \\boxed{33}")
    rendered = qwen_tokenizer.decode(data["prompt_token_ids"])
    assert '{"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}}' in rendered


async def test_chat_qwen3_reasoning_and_template_kwargs(session: aiohttp.ClientSession, qwen3_tokenizer: Any) -> None:
    async with running_engine(template="qwen3") as eng:
        messages = [{"role": "user", "content": QUESTION}]
        status, data = await post(session, eng.url + "/v1/chat/completions", {"messages": messages, "rid": "q"})
        assert status == 200
        message = data["choices"][0]["message"]
        assert message["reasoning_content"] and "<think>" not in message["content"]
        assert "\\boxed{" in message["content"]
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
        status, data = await post(session, eng.url + "/v1/chat/completions", body)
        assert status == 200
        assert qwen3_tokenizer.decode(data["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        assert data["choices"][0]["message"]["reasoning_content"] is None
        assert 151667 not in data["choices"][0]["token_ids"]


async def test_chat_continue_final_message_and_length(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Let me think"}]
    body = {"messages": messages, "continue_final_message": True, "return_token_ids": True, "max_tokens": 3}
    status, data = await post(session, engine.url + "/v1/chat/completions", body)
    assert status == 200
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(data["choices"][0]["token_ids"]) == 3
    tail = qwen_tokenizer.encode("assistant\nLet me think", add_special_tokens=False)
    assert data["prompt_token_ids"][-len(tail) :] == tail  # the partial turn is left open


async def test_error_faults_by_count_and_rate(engine: TestEngine, session: aiohttp.ClientSession) -> None:
    engine.configure(fail_next=2)
    statuses = [(await post(session, engine.url + "/generate", {"input_ids": [1, 2]}))[0] for _ in range(3)]
    assert statuses == [500, 500, 200]
    status, _ = await post(session, engine.url + "/_test/config", {"error_rate": 1.0})
    assert status == 200
    status, data = await post(
        session, engine.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 500 and "error" in data
    status, data = await post(session, engine.url + "/_test/config", {"no_such_knob": 1})
    assert status == 400 and "no_such_knob" in data["message"]
    async with session.get(engine.url + "/_test/stats") as resp:
        stats = await resp.json()
    assert stats["errors_injected"] == 3 and stats["requests"] == 4
    assert stats["endpoints"] == {"/generate": 3, "/v1/chat/completions": 1}


async def test_malformed_and_injected_abort(
    engine: TestEngine, session: aiohttp.ClientSession, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    engine.configure(malformed_next=2)
    for rid in ("m1", "m2"):
        async with session.post(engine.url + "/generate", json={"input_ids": ids, "rid": rid}) as resp:
            assert resp.status == 200
            raw = await resp.read()
        with pytest.raises(ValueError):
            json.loads(raw)
    full = await generate(session, engine, ids, rid="ab")
    engine.configure(abort_next=1)
    aborted = await generate(session, engine, ids, rid="ab")
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < len(full["output_ids"])
    assert aborted["output_ids"] == full["output_ids"][: len(aborted["output_ids"])]
    assert len(aborted["meta_info"]["output_token_logprobs"]) == len(aborted["output_ids"])
    stats = engine.stats_dict()
    assert stats["malformed"] == 2 and stats["aborts_injected"] == 1


async def test_fault_rates(session: aiohttp.ClientSession) -> None:
    async with running_engine(abort_rate=1.0) as eng:
        out = await generate(session, eng, [1, 2, 3])
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        eng.configure(abort_rate=0.0, malformed_rate=1.0)
        async with session.post(eng.url + "/generate", json={"input_ids": [1, 2, 3]}) as resp:
            assert resp.status == 200
            with pytest.raises(ValueError):
                json.loads(await resp.read())
        eng.configure(malformed_rate=0.0, error_rate=0.5, seed=11)
        statuses = [(await post(session, eng.url + "/generate", {"input_ids": [1, 2]}))[0] for _ in range(40)]
        assert 8 <= statuses.count(500) <= 32 and statuses.count(200) == 40 - statuses.count(500)
        eng.configure(error_rate=0.0, seed=11, hang_rate=1.0)
        with pytest.raises(asyncio.TimeoutError):
            await session.post(eng.url + "/generate", json={"input_ids": [1]}, timeout=aiohttp.ClientTimeout(total=0.2))
        stats = eng.stats_dict()
        assert stats["aborts_injected"] == 1 and stats["malformed"] == 1 and stats["hangs"] == 1
        assert stats["errors_injected"] == statuses.count(500)


async def test_hang_until_client_gives_up_and_clean_shutdown(session: aiohttp.ClientSession) -> None:
    eng = TestEngine(hang_next=2)
    await eng.start()
    with pytest.raises(asyncio.TimeoutError):
        async with session.post(
            eng.url + "/generate", json={"input_ids": [1, 2]}, timeout=aiohttp.ClientTimeout(total=0.3)
        ) as resp:
            await resp.read()
    pending = asyncio.create_task(post(session, eng.url + "/generate", {"input_ids": [1, 2]}))
    await asyncio.sleep(0.2)
    assert eng.stats_dict()["hangs"] == 2 and not pending.done()
    started = time.monotonic()
    await eng.stop()
    assert time.monotonic() - started < 2.5
    status, _ = await pending
    assert status == 503


async def test_abort_request_returns_partial_output(session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])
    async with running_engine(latency_s=2.0) as eng:
        started = time.monotonic()
        task = asyncio.create_task(generate(session, eng, ids, rid="victim"))
        await asyncio.sleep(0.5)
        status, _ = await post(session, eng.url + "/abort_request", {"rid": "victim"})
        assert status == 200
        out = await task
        assert time.monotonic() - started < 1.5
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["finish_reason"]["message"]
        assert IM_END not in out["output_ids"]
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
        assert eng.stats_dict()["aborts_requested"] == 1


async def test_update_weight_version(session: aiohttp.ClientSession) -> None:
    async with running_engine(latency_s=1.0) as eng:
        keep = asyncio.create_task(generate(session, eng, [1, 2, 3], rid="keep"))
        await asyncio.sleep(0.2)
        status, data = await post(
            session, eng.url + "/update_weight_version", {"new_version": "v7", "abort_all_requests": False}
        )
        assert status == 200 and data["success"] and data["new_version"] == "v7"
        kept = await keep
        assert kept["meta_info"]["finish_reason"]["type"] == "stop"
        assert kept["meta_info"]["weight_version"] == "v7"
        victim = asyncio.create_task(generate(session, eng, [1, 2, 3], rid="victim"))
        await asyncio.sleep(0.2)
        status, data = await post(session, eng.url + "/update_weight_version", {"new_version": "v8"})
        assert status == 200
        aborted = await victim
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        async with session.get(eng.url + "/get_model_info") as resp:
            info = await resp.json()
        assert info["weight_version"] == "v8"


async def test_generate_reports_the_current_weight_version(session: aiohttp.ClientSession) -> None:
    async with running_engine(weight_version="w0") as eng:
        first = await generate(session, eng, [1, 2, 3], rid="before")
        assert first["meta_info"]["weight_version"] == "w0"
        status, _ = await post(session, eng.url + "/update_weight_version", {"new_version": "w1"})
        assert status == 200
        after = await generate(session, eng, [1, 2, 3], rid="before")
        assert after["meta_info"]["weight_version"] == "w1"
        assert after["output_ids"] == first["output_ids"], "the version is reported, the scripted output is the same"
        status, batch = await post(session, eng.url + "/generate", {"input_ids": [[1, 2], [3, 4]], "rid": ["b0", "b1"]})
        assert status == 200 and [out["meta_info"]["weight_version"] for out in batch] == ["w1", "w1"]
        status, chat = await post(
            session, eng.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2 + 3?"}]}
        )
        assert status == 200 and chat["metadata"]["weight_version"] == "w1"
        async with session.get(eng.url + "/get_server_info") as resp:
            server = await resp.json()
        assert server["weight_version"] == "w1" and server["internal_states"] == [{"weight_version": "w1"}]


async def test_engine_ids_and_request_counters_tell_engines_apart(session: aiohttp.ClientSession) -> None:
    async with running_engine(engine_id="engine-a") as named, running_engine() as unnamed:
        assert unnamed.engine_id == unnamed.url.removeprefix("http://"), "by default an engine is its host:port"
        sent = {named.url: 3, unnamed.url: 5}
        for url, count in sent.items():
            for i in range(count):
                async with session.post(url + "/generate", json={"input_ids": [1, 2, i]}) as resp:
                    assert resp.status == 200
                    served_by = resp.headers["X-Test-Engine-Id"]
                assert served_by == ("engine-a" if url == named.url else unnamed.engine_id)
        async with session.get(named.url + "/no_such_path") as resp:  # every answer names its engine
            assert resp.status == 404 and resp.headers["X-Test-Engine-Id"] == "engine-a"
        for eng in (named, unnamed):
            async with session.get(eng.url + "/get_model_info") as resp:
                assert (await resp.json())["engine_id"] == eng.engine_id
            async with session.get(eng.url + "/_test/stats") as resp:
                stats = await resp.json()
            assert stats["engine_id"] == eng.engine_id
            assert stats["requests"] == stats["completed"] == sent[eng.url]
            assert stats["endpoints"] == {"/generate": sent[eng.url], "/get_model_info": 1}
        status, _ = await post(session, named.url + "/_test/reset_stats", {})
        assert status == 200
        assert named.stats_dict()["requests"] == 0 and named.stats_dict()["engine_id"] == "engine-a"
        assert unnamed.stats_dict()["requests"] == 5
    for bad in ("", "two\nlines", "naïve"):
        with pytest.raises(ValueError, match="engine_id"):
            TestEngine(engine_id=bad)


async def test_info_and_health_endpoints(engine: TestEngine, session: aiohttp.ClientSession) -> None:
    for path in ("/health", "/health_generate"):
        async with session.get(engine.url + path) as resp:
            assert resp.status == 200
    async with session.get(engine.url + "/get_model_info") as resp:
        info = await resp.json()
    assert info["is_generation"] is True
    assert info["tokenizer_path"] == str(qwen_tokenizer_dir("qwen2.5"))
    assert (Path(info["model_path"]) / "tokenizer.json").is_file()
    async with session.get(engine.url + "/get_server_info") as resp:
        server = await resp.json()
    assert server["chat_template"] == "qwen2.5" and server["weight_version"] == "default"


async def test_determinism_under_seed(session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": QUESTION}])

    async def run(seed: int) -> list[list[int]]:
        async with running_engine(seed=seed) as eng:
            by_rid = [(await generate(session, eng, ids, rid=f"d{i}"))["output_ids"] for i in range(3)]
            repeats = [(await generate(session, eng, ids))["output_ids"] for _ in range(3)]
            return by_rid + repeats

    first, again, other = await run(7), await run(7), await run(8)
    assert first == again
    assert first != other
    assert len({tuple(x) for x in first}) == 6  # rids and repeats of one prompt all differ


async def test_custom_responder_gets_prompt_text(session: aiohttp.ClientSession, qwen_tokenizer: Any) -> None:
    seen: list[str] = []

    def responder(prompt_text: str, rng: Any) -> str:
        seen.append(prompt_text)
        return f"custom {rng.randint(0, 9)}"

    async with running_engine(responder=responder, noise_tokens=(0, 0)) as eng:
        ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": "Say something"}])
        out = await generate(session, eng, ids, rid="z")
    assert seen == [qwen_tokenizer.decode(ids)]
    assert re.fullmatch(r"custom \d", out["text"])
    assert out["output_ids"] == qwen_tokenizer.encode(out["text"], add_special_tokens=False) + [IM_END]


async def test_many_concurrent_requests(session: aiohttp.ClientSession) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with running_engine(latency_s=0.5) as eng, aiohttp.ClientSession(connector=connector) as many:
        started = time.monotonic()
        results = await asyncio.gather(
            *(post(many, eng.url + "/generate", {"input_ids": [1, 2, i % 50000]}) for i in range(1024))
        )
        elapsed = time.monotonic() - started
        assert all(status == 200 for status, _ in results)
        assert all(data["output_ids"][-1] == IM_END for _, data in results)
        stats = eng.stats_dict()
        assert stats["completed"] == 1024 and stats["in_flight"] == 0
        assert stats["max_in_flight"] >= 256
        assert elapsed < 20


def test_run_engine_in_thread_for_sync_tests() -> None:
    with run_engine_in_thread(seed=3, weight_version="w1") as eng:
        request = urllib.request.Request(
            eng.url + "/generate",
            data=json.dumps({"input_ids": [1, 2, 3], "rid": "s"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            out = json.loads(resp.read())
        assert out["meta_info"]["weight_version"] == "w1"
        assert out["output_ids"][-1] == IM_END
        eng.configure(fail_next=1)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 500
        url = eng.url
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=2)


def test_cli_serves_until_terminated(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_buffer.testing.engine", "--port", "0", "--seed", "5", "--template", "qwen3",
         "--engine-id", "cli-engine"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        url = line.strip().rsplit(" ", 1)[-1]
        assert '"tokenizer_path": "test:qwen3"' in proc.stdout.readline(), "the name /start_rollout takes"
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
            info = json.loads(resp.read())
            assert resp.headers["X-Test-Engine-Id"] == "cli-engine"
        assert info["chat_template"] == "qwen3" and info["test_engine_config"]["seed"] == 5
        assert info["engine_id"] == "cli-engine"
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _raw_exchange(url: str, payload: bytes, expect: int, timeout_s: float = 10.0) -> list[bytes]:
    """Send raw bytes on one connection and read `expect` HTTP responses (Content-Length framed)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    answers: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(payload)
            await writer.drain()
            while len(answers) < expect:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"HTTP/1.1 100"):
                    answers.append(head)
                    continue
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                answers.append(head + await reader.readexactly(length))
    finally:
        writer.close()
    return answers


async def test_http_server_keeps_alive_answers_pipelined_requests_in_order_and_refuses_properly(
    engine: TestEngine, session: aiohttp.ClientSession
) -> None:
    def request(path: str, body: bytes = b"", method: str = "POST", extra: str = "") -> bytes:
        return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body

    slow = json.dumps({"input_ids": [1, 2, 3], "rid": "first"}).encode()
    answers = await _raw_exchange(engine.url, request("/generate", slow) + request("/health", method="GET")
                                  + request("/nowhere") + request("/generate", method="GET"), expect=4)
    assert answers[0].startswith(b"HTTP/1.1 200") and b'"id":"first"' in answers[0], "answers keep request order"
    assert answers[1].startswith(b"HTTP/1.1 200")
    assert answers[2].startswith(b"HTTP/1.1 404")
    assert answers[3].startswith(b"HTTP/1.1 405") and b"Allow: POST" in answers[3]
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
               b"a\r\n{\"input_id\r\n" + b"%x\r\n" % len(b's": [4, 5], "rid": "ck"}') + b's": [4, 5], "rid": "ck"}'
               + b"\r\n0\r\n\r\n")
    continued, answer = await _raw_exchange(engine.url, chunked, expect=2)
    assert continued.startswith(b"HTTP/1.1 100") and b'"id":"ck"' in answer
    bad = await _raw_exchange(engine.url, b"BROKEN\r\n\r\n", expect=1)
    assert bad[0].startswith(b"HTTP/1.1 400")
    closing = await _raw_exchange(engine.url, request("/health", method="GET", extra="Connection: close\r\n"), 1)
    assert b"Connection: close" in closing[0]
    async with session.get(engine.url + "/v1/models") as resp:  # an ordinary client, for good measure
        assert resp.status == 200 and (await resp.json())["object"] == "list"


async def test_http_server_refuses_oversized_bodies(monkeypatch: pytest.MonkeyPatch, engine: TestEngine,
                                                    session: aiohttp.ClientSession) -> None:
    from rollout_buffer.testing.engine import http_server

    monkeypatch.setattr(http_server, "_MAX_BODY", 1000)
    async with session.post(engine.url + "/generate", json={"input_ids": list(range(1000))}) as resp:
        assert resp.status == 413
    status, _ = await post(session, engine.url + "/generate", {"input_ids": [1, 2]})
    assert status == 200


def test_engine_decoding_equals_the_tokenizer_on_non_round_trip_ids(qwen_tokenizer: Any) -> None:
    import random as random_module

    from rollout_buffer.testing.engine import noise_tokens
    from rollout_buffer.testing.engine.codec import codec_for
    from rollout_buffer.testing.tokenizer import NUM_REGULAR_TOKENS

    codec = codec_for(qwen_tokenizer)
    rng = random_module.Random(3)
    special = [151643, 151644, 151645, 151657, 151658]
    for _ in range(300):
        ids = noise_tokens(rng, rng.randint(1, 20))
        ids += [rng.choice(special) for _ in range(rng.randint(0, 3))] + [rng.randrange(NUM_REGULAR_TOKENS)]
        rng.shuffle(ids)
        for skip in (False, True):
            assert codec.decode(ids, skip_special_tokens=skip) == qwen_tokenizer.decode(ids, skip_special_tokens=skip)
    text = "Héllo <tool_call>\n{\"a\": 1}\n</tool_call> 12 + 7"
    assert codec.encode(text) == qwen_tokenizer.encode(text, add_special_tokens=False)
