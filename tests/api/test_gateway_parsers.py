"""Gateway output parsing: every named tool-call parser on its model's real markup, malformed markup
kept as text and counted (never a 500), and `<think>` reasoning in each API's shape (Qwen3 template)."""

from __future__ import annotations

import json
import random
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rollout_buffer.api.gateway.parsers import OutputParser
from rollout_buffer.tasks.chat_format import extract_tool_calls
from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.gateway import CALCULATOR, finish, new_session, read_group, start_external
from tests.support.helpers import ServerProcess, ServerSpec

ARGS = {"city": "Paris", "days": 3}
MARKUP = {
    "qwen25": 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "deepseekv3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
                  '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": "Let me check.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
}
BROKEN = {
    "qwen25": 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Par\n</tool_call>',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n",
    "deepseekv3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
                  '{"city": \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": "Let me check.\n<tool_call>\n</tool_call>",
}


@pytest.mark.parametrize("name", sorted(MARKUP))
def test_each_parser_reads_its_models_markup(name: str) -> None:
    parsed = OutputParser(tool_call_parser=name).parse(MARKUP[name], id_prefix="call_0")
    assert parsed.content == "Let me check." and parsed.malformed == 0
    [call] = parsed.tool_calls
    assert call["id"] == "call_0_0" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == ARGS
    broken = OutputParser(tool_call_parser=name).parse(BROKEN[name], id_prefix="call_0")
    assert broken.tool_calls == [] and broken.malformed == 1 and broken.content.startswith("Let me check.")


CALL_BODIES = {  # body -> the arguments both readers must find, or None when the call is malformed
    '{"name": "f", "arguments": {"a": 1}}': {"a": 1},
    '{"name": "f", "arguments": "{\\"a\\": 1}"}': {"a": 1},  # OpenAI style: arguments as a JSON string
    '{"name": "f", "parameters": {"a": [1, 2]}}': {"a": [1, 2]},
    '{"name": "f"}': {},
    '{"name": "f", "arguments": null}': {},
    '{"name": "f", "arguments": "[1, 2]"}': None,  # a string holding JSON that is not an object
    '{"name": "f", "arguments": "{bad"}': None,
    '{"name": "f", "arguments": [1]}': None,
    '{"name": "", "arguments": {}}': None,
    '{"arguments": {}}': None,
}


@pytest.mark.parametrize("body", sorted(CALL_BODIES))
def test_the_gateway_and_the_task_runtime_read_a_call_body_alike(body: str) -> None:
    """One rule for both readers of `<tool_call>` JSON: a call one keeps, the other keeps with the same
    arguments; a call one returns as text, so does the other."""
    text = f"Go.\n<tool_call>\n{body}\n</tool_call>"
    gateway = OutputParser(tool_call_parser="qwen25").parse(text, id_prefix="c")
    _, runtime = extract_tool_calls(text)
    expected = CALL_BODIES[body]
    if expected is None:
        assert gateway.tool_calls == [] and runtime == [] and gateway.malformed == 1
        return
    [mine], [theirs] = gateway.tool_calls, runtime
    assert json.loads(mine["function"]["arguments"]) == json.loads(theirs["function"]["arguments"]) == expected
    if '"arguments": "' in body:  # the model's own string is kept as written by the task runtime
        assert theirs["function"]["arguments"] == json.loads(body)["arguments"]


def test_think_blocks_become_reasoning() -> None:
    parsed = OutputParser().parse("<think>\nadd them\n</think>\n\nIt is 5.<|im_end|>", id_prefix="c")
    assert (parsed.reasoning, parsed.content) == ("add them", "It is 5.")
    raw = OutputParser(reasoning_parser="none").parse("<think>x</think>y", id_prefix="c")
    assert raw.content == "<think>x</think>y" and raw.reasoning is None


def malformed_responder(prompt: str, rng: random.Random) -> str:
    return 'Calling.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'


SERVER = ServerSpec(args=("--session-timeout-s", "60"))


def test_malformed_tool_call_is_returned_as_text_and_counted(server: ServerProcess, qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=3, responder=malformed_responder) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "broken")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        reply = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "2 + 2?"}],
                                            tools=[CALCULATOR])
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert "<tool_call>" in choice.message.content
        assert client.get(f"/runs/{run_id}").json()["stats"]["gateway_malformed_tool_calls"] == 1


def test_qwen3_reasoning_in_each_api(server: ServerProcess) -> None:
    path = str(qwen_tokenizer_dir("qwen3"))
    with run_engine_in_thread(template="qwen3", seed=5) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, path, repeats=2, reasoning_parser="qwen3")
        first = new_session(client, run_id, "think")
        sdk = openai.OpenAI(base_url=first["openai_base_url"], api_key=first["api_key"], max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 3 + 5?"}]
        reply = sdk.chat.completions.create(model="m", messages=messages).choices[0].message
        reasoning = reply.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in reply.content and "\\boxed{" in reply.content
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "And 8 + 1?"}]
        sdk.chat.completions.create(model="m", messages=messages)  # reasoning dropped by the client: no fork
        second = new_session(client, run_id, "think")
        claude = anthropic.Anthropic(base_url=second["anthropic_base_url"], api_key=second["api_key"], max_retries=0)
        message = claude.messages.create(model="m", max_tokens=300,
                                         messages=[{"role": "user", "content": "What is 3 + 5?"}])
        assert [b.type for b in message.content] == ["thinking", "text"] and message.content[0].thinking
        for session in (first, second):
            finish(client, session, 1.0)
        records = read_group(client, run_id, 2)
        stats = client.get(f"/runs/{run_id}").json()["stats"]
        assert "gateway_forks" not in stats and stats["gateway_turns"] == 3
        record = next(r for r in records if r["uid"] == first["session_id"])
        assert record["messages"][1]["reasoning_content"] == reasoning
