"""Parsing generated text into assistant messages."""

from __future__ import annotations

import json
from typing import Any

from rollout_buffer.tasks.chat_format import parse_assistant_text


def test_plain_answer_strips_end_marker() -> None:
    assert parse_assistant_text("The answer is 4.<|im_end|>") == {"role": "assistant", "content": "The answer is 4."}
    assert parse_assistant_text("done<|endoftext|>")["content"] == "done"
    assert parse_assistant_text("")["content"] == ""


def test_think_block_becomes_reasoning_content() -> None:
    msg = parse_assistant_text("<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4<|im_end|>")
    assert msg == {"role": "assistant", "content": "The answer is 4", "reasoning_content": "Let me add.\n2+2=4"}


def test_reasoning_opened_by_generation_prompt() -> None:
    msg = parse_assistant_text("thinking hard\n</think>\n\n\\boxed{7}")
    assert msg["reasoning_content"] == "thinking hard"
    assert msg["content"] == "\\boxed{7}"


def test_truncated_reasoning_has_no_content() -> None:
    msg = parse_assistant_text("<think>\nstill going")
    assert msg == {"role": "assistant", "content": "", "reasoning_content": "still going"}


def test_tool_calls_are_extracted_with_deterministic_ids() -> None:
    text = (
        "<think>\nuse the tool\n</think>\n\nLet me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"π\\"}"}\n</tool_call><|im_end|>'
    )
    msg = parse_assistant_text(text, id_prefix="turn3")
    assert msg["content"] == "Let me compute."
    assert msg["reasoning_content"] == "use the tool"
    calls: list[dict[str, Any]] = msg["tool_calls"]
    assert [c["id"] for c in calls] == ["turn3_0", "turn3_1"]
    assert all(c["type"] == "function" for c in calls)
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "12 + 7 * 3"}'}
    assert calls[1]["function"]["name"] == "lookup"
    assert json.loads(calls[1]["function"]["arguments"]) == {"q": "π"}
    assert parse_assistant_text(text, id_prefix="turn3") == msg


def test_malformed_tool_call_stays_in_content() -> None:
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
    good = '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>'
    msg = parse_assistant_text(f"{bad}\n{good}<|im_end|>")
    assert msg["content"] == bad
    assert msg["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    ]
    no_name = parse_assistant_text('<tool_call>{"arguments": {}}</tool_call>')
    assert "tool_calls" not in no_name and no_name["content"] == '<tool_call>{"arguments": {}}</tool_call>'
    unclosed = parse_assistant_text('<tool_call>\n{"name": "calculator"')
    assert "tool_calls" not in unclosed and unclosed["content"].startswith("<tool_call>")


def test_tool_call_inside_reasoning_is_not_a_call() -> None:
    text = '<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>answer'
    msg = parse_assistant_text(text)
    assert "tool_calls" not in msg
    assert msg["content"] == "answer"
    assert "<tool_call>" in msg["reasoning_content"]


def test_parsed_call_rerenders_like_model_output(qwen_tokenizer: Any) -> None:
    generated = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    msg = parse_assistant_text(generated + "<|im_end|>")
    rendered = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "q"}, msg], tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n" + generated + "<|im_end|>\n")
