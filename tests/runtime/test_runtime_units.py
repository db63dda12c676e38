"""Runtime parts on their own: token-exact prompt extension on three real chat templates, the history
guard, input files, run options, the task queue on a real Redis, the engine clients against the test
engine, and the built-in tasks' tools and rewards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollout_buffer.runs.lifecycle import StartRolloutError
from rollout_buffer.runtime.chat_client import ChatCompletionsClient
from rollout_buffer.runtime.engine_http import RetryPolicy, new_session
from rollout_buffer.runtime.history import HistoryGuard
from rollout_buffer.runtime.inputs import read_samples
from rollout_buffer.runtime.jobqueue import JobQueue
from rollout_buffer.runtime.options import RunOptions
from rollout_buffer.runtime.plan import iter_job_plan
from rollout_buffer.runtime.prompt_tokens import PromptTokens
from rollout_buffer.runtime.sglang_client import GenerateClient
from rollout_buffer.store import keys
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.builtin.boxed import answers_match, boxed_reward, extract_boxed
from rollout_buffer.tasks.builtin.calculator_generator import TOOLS, calculate, run_tool_call
from rollout_buffer.tasks.contract import HistoryRewriteError
from rollout_buffer.testing.engine import running_engine
from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from rollout_buffer.wire.schema import StartRolloutRequest

CALL = {"id": "call_0_0", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}}
USER = {"role": "user", "content": "What is 1 + 2?"}
ASSISTANT = {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]}
TOOL = {"role": "tool", "tool_call_id": "call_0_0", "content": "3"}


def _assistant_body(tokenizer: Any, template_text: str, before: str) -> str:
    """The text the template renders for the assistant turn, between the generation prompt and <|im_end|>."""
    assert template_text.startswith(before)
    return template_text[len(before):].split("<|im_end|>")[0]


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
def test_extension_equals_the_template_rendering_when_the_model_output_is_canonical(template: str) -> None:
    tokenizer = load_qwen_tokenizer(template)
    prompt = PromptTokens(tokenizer, TOOLS)
    first = prompt.first([USER])
    before = prompt.render([USER], add_generation_prompt=True)
    full = prompt.render([USER, ASSISTANT, TOOL], add_generation_prompt=True)
    body = _assistant_body(tokenizer, full, before)
    output = prompt.encode(body) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    extended = prompt.extend(first, output, [USER], [TOOL])
    assert extended == prompt.encode(full)


def test_extension_after_a_truncated_output_closes_the_turn_with_template_tokens() -> None:
    tokenizer = load_qwen_tokenizer("qwen2.5")
    prompt = PromptTokens(tokenizer, None)
    first = prompt.first([USER])
    output = prompt.encode("The answer is")  # hit max_new_tokens: no <|im_end|>
    extended = prompt.extend(first, output, [USER], [{"role": "user", "content": "Go on."}])
    assert extended[:len(first) + len(output)] == first + output
    tail = tokenizer.decode(extended[len(first) + len(output):], skip_special_tokens=False)
    assert tail == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"


def test_extension_with_the_r1_template_tool_outputs() -> None:
    tokenizer = load_qwen_tokenizer("r1_distill")
    prompt = PromptTokens(tokenizer, TOOLS)
    first = prompt.first([USER])
    assert tokenizer.decode(first, skip_special_tokens=False).endswith("<｜Assistant｜><think>\n")
    output = prompt.encode("ok</think>call") + [tokenizer.eos_token_id]
    extended = prompt.extend(first, output, [USER], [TOOL])
    tail = tokenizer.decode(extended[len(first) + len(output):], skip_special_tokens=False)
    assert tail == "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>3<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"


def test_history_guard_allows_appends_and_refuses_rewrites() -> None:
    guard = HistoryGuard()
    assert guard.new_messages([USER], TOOLS) == [USER]
    assistant = {"role": "assistant", "content": "x", "tool_calls": [CALL]}
    guard.record([USER], TOOLS, assistant)
    assert guard.new_messages([USER, assistant, TOOL], TOOLS) == [TOOL]
    with pytest.raises(HistoryRewriteError, match="messages\\[0\\]"):
        guard.new_messages([{"role": "user", "content": "edited"}, assistant, TOOL], TOOLS)
    with pytest.raises(HistoryRewriteError, match="history must grow"):
        guard.new_messages([USER], TOOLS)
    with pytest.raises(HistoryRewriteError, match="tool list"):
        guard.new_messages([USER, assistant, TOOL], None)
    assistant["content"] = "changed after the call"  # the task mutating the returned message is a rewrite too
    with pytest.raises(HistoryRewriteError):
        guard.new_messages([USER, assistant, TOOL], TOOLS)


def test_input_ids_are_assigned_from_line_numbers_and_duplicates_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "instance_id": 7}\n{"prompt": "c"}\n')
    assert [s["instance_id"] for s in read_samples(path)] == ["0", "7", "3"]
    assert read_samples(path) == read_samples(path), "ids are stable across reads"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "instance_id": "0"}\n')
    with pytest.raises(StartRolloutError, match="line 2: duplicate instance_id '0' \\(first on line 1\\)"):
        read_samples(path)
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(StartRolloutError, match="line 2: expected a JSON object"):
        read_samples(path)
    path.write_text('{"prompt": "a", "instance_id": true}\n')
    with pytest.raises(StartRolloutError, match="line 1"):
        read_samples(path)


def test_run_options_coerce_slime_strings_and_name_bad_fields() -> None:
    request = StartRolloutRequest(task_type="math", input_file="x", remote_engine_url="http://e/", max_tokens=64,
                                  sampling_params={"temperature": "0.7", "top_p": "1", "top_k": "20"},
                                  engine_retries="2", engine_timeout_s="5")
    options = RunOptions.from_request(request, rollout_timeout_s=30)
    assert options.sampling_params == {"temperature": 0.7, "top_p": 1.0, "top_k": 20, "max_new_tokens": 64}
    assert (options.engine_retries, options.engine_timeout_s, options.engine_url) == (2, 5.0, "http://e")
    assert options.engine_api == "generate" and options.rollout_timeout_s == 30
    inside = StartRolloutRequest(task_type="m", input_file="x", sampling_params={"max_tokens": "32"})
    assert RunOptions.from_request(inside, rollout_timeout_s=1).sampling_params["max_new_tokens"] == 32
    for field, value in (("engine_api", "grpc"), ("engine_retries", "-1"), ("engine_timeout_s", "soon")):
        bad = StartRolloutRequest(task_type="m", input_file="x", **{field: value})
        with pytest.raises(StartRolloutError) as caught:
            RunOptions.from_request(bad, rollout_timeout_s=1)
        assert caught.value.field == field



async def test_enqueue_is_idempotent_resumable_and_counts_exactly(redis_store: Store) -> None:
    run_id = "unit-run"
    await redis_store.create_run(run_id, {}, group_size=2, num_epoch=2, task_type="math")
    samples = [{"instance_id": f"s{i}", "prompt": str(i)} for i in range(3)]
    queue = JobQueue(redis_store.redis, run_id)
    # A launch that died half way through enqueueing: its first tasks are in the stream already.
    plan = [x for seq, e, i, r in list(iter_job_plan(["s0", "s1", "s2"], 2, 2))[:5] for x in (seq, e, i, r)]
    await queue._enqueue(keys=[queue.stream, keys.stats(run_id), keys.run_meta(run_id)], args=plan)
    trained = {"0:s1", "1:s1"}  # both of s1's groups (epochs 0 and 1) were trained: excluded from the plan
    assert await queue.enqueue(samples, num_epoch=2, repeats=2, excluded=trained) == 8 - 4 + 1
    assert await queue.enqueue(samples, num_epoch=2, repeats=2, excluded=trained) == 0
    entries = await redis_store.redis.xrange(queue.stream)
    assert [e[0] for e in entries][:3] == [b"0-1", b"0-2", b"0-3"]
    assert (await redis_store.stats(run_id))["tasks_queued"] == 10, "5 from the first launch, 5 from the second"
    assert (await redis_store.run_meta(run_id))["tasks_total"] == "8", "s1 is excluded from the plan"
    tasks = await queue.read_new("c1", 100, 10)
    assert len(tasks) == 10 and len({t.uid(run_id) for t in tasks}) == 10
    assert [t.instance_id for t in tasks].count("s1") == 2, "only the first launch enqueued s1"
    assert tasks[0].uid(run_id) == "unit-run:0:s0:0"
    await redis_store.add_skip_groups(run_id, ["0:s1"])  # the trainer says it trained s1's epoch-0 group
    started = [await queue.start(task) for task in tasks]
    assert [(c.proceed, c.attempt) for c in started].count((True, 1)) == 8
    assert all(c.previous == "skipped" and not c.proceed for c, t in zip(started, tasks) if t.instance_id == "s1")
    assert started[0].sample == samples[0]
    again = await queue.start(tasks[0])  # redelivered (a reclaim): one more attempt, still running
    assert (again.previous, again.attempt, again.proceed) == ("running", 2, True)
    work = [t for t in tasks if t.instance_id != "s1"]
    for task in work[:-1]:
        assert await queue.finish(task, "done", {"engine_calls": 2}) == "running"
    assert (await redis_store.run_meta(run_id))["status"] == "running"
    await queue.finish(work[-1], "failed", {"engine_calls": 1, "rollout_errors:X": 1})
    assert await queue.finish(work[-1], "done") == "failed", "terminal states do not change"
    stats = await redis_store.stats(run_id)
    assert (stats["tasks_queued"], stats["tasks_running"], stats["tasks_done"], stats["tasks_failed"],
            stats["tasks_skipped"]) == (0, 0, 7, 1, 2)
    assert stats["engine_calls"] == 15 and stats["rollout_errors:X"] == 1
    assert (await redis_store.run_meta(run_id))["status"] == "finished"
    pending = await redis_store.redis.xpending(queue.stream, keys.WORKER_GROUP)
    assert pending["pending"] == 0, "every entry was acknowledged"
    assert await queue.sample("s2") == samples[2]


async def test_generate_client_continues_an_abort_and_sends_the_routing_key(qwen_tokenizer: Any) -> None:
    async with running_engine(template="qwen2.5", seed=3) as engine:
        session = new_session()
        try:
            engine.configure(abort_next=1)
            stats: Counter[str] = Counter()
            client = GenerateClient(session=session, engine=engine.url, tokenizer=qwen_tokenizer, tools=None,
                                    sampling_params={"max_new_tokens": 200}, policy=RetryPolicy(timeout_s=10),
                                    routing_key="run:0:a:0", stats=stats)
            result = await client.chat([{"role": "user", "content": "What is 20 + 22?"}])
            turn = client.turns[0]
            prompt = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "What is 20 + 22?"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)
            assert turn["prompt_ids"] == list(prompt) and turn["finish_reason"] == "stop"
            assert len(turn["output_logprobs"]) == len(turn["output_ids"])
            engine_stats = engine.stats_dict()
            assert engine_stats["aborts_injected"] == 1 and stats["engine_abort_continuations"] == 1
            partial = engine_stats["prompt_tokens"] - 2 * len(prompt)  # the continuation's prompt = prompt + partial
            assert 0 < partial < len(turn["output_ids"]) == engine_stats["generated_tokens"]
            assert engine_stats["routing_key_requests"] == 2
            assert "\\boxed{" in result.message["content"]
        finally:
            await session.close()


async def test_chat_client_continues_an_abort_with_continue_final_message() -> None:
    async with running_engine(template="qwen2.5", seed=4) as engine:
        session = new_session()
        try:
            engine.configure(abort_next=1)
            stats: Counter[str] = Counter()
            client = ChatCompletionsClient(session=session, engine=engine.url, model="m", tools=TOOLS,
                                           sampling_params={"max_new_tokens": 200}, policy=RetryPolicy(timeout_s=10),
                                           routing_key="r", stats=stats)
            result = await client.chat([{"role": "user", "content": "What is 6 * 7?"}])
            assert result.finish_reason == "stop" and stats["engine_calls"] == 2
            assert result.message["tool_calls"][0]["function"]["name"] == "calculator"
            assert client.turns == []
        finally:
            await session.close()


def test_calculator_tool_is_arithmetic_only() -> None:
    assert calculate("2 * (3 + 4)") == "14" and calculate("10 / 4") == "2.5" and calculate("-3 - -3") == "0"
    assert calculate("__import__('os').system('true')").startswith("error")
    assert calculate("2 ** 1000000").startswith("error"), "powers can explode; not supported"
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("1+" * 200 + "1").startswith("error")
    assert run_tool_call({"function": {"name": "shell", "arguments": "{}"}}).startswith("error: unknown tool")
    assert run_tool_call({"function": {"name": "calculator", "arguments": "not json"}}).startswith("error")
    assert run_tool_call(CALL) == "3"


def test_boxed_answers() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and finally \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("no box") is None and extract_boxed("\\boxed{unclosed") is None
    assert answers_match("\\frac{1}{2}", "0.5") and answers_match("1,234", "1234") and answers_match(" 42. ", 42)
    assert answers_match("7", "\\boxed{7}") and not answers_match("7", "8") and not answers_match(None, "8")
    assert boxed_reward("The answer is \\boxed{43}", "43") == 1.0 and boxed_reward("43", "43") == 0.0
