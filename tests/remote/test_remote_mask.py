"""The protocol's response_mask count (`remote.mask`) and its drift report (`remote.drift`), with the real
Qwen tokenizers and chat templates, on assistant turns in the shapes a model and an OpenAI client produce
(tool calls with string `arguments`, compact JSON, whitespace at the turn's edges)."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_buffer.remote.drift import DIFF_LIMIT, DriftTally, common_prefix, measure_drift
from rollout_buffer.remote.engine import token_ids_of
from rollout_buffer.remote.mask import MaskCountError, ResponseMaskCounter, end_of_turn_id
from rollout_buffer.tasks.chat_format import parse_assistant_text
from tests.fixtures.remote_tasks.remote_calculator_generator import TOOLS

QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def reply(tok: Any, sampled: str, *, closed: bool = True) -> tuple[list[int], dict[str, Any]]:
    """The model's ids for `sampled` (plus its end-of-turn token) and the assistant message a server parses
    from it (tool-call `arguments` as a JSON string, as OpenAI clients see them)."""
    ids = encode(tok, sampled) + ([end_of_turn_id(tok)] if closed else [])
    return ids, parse_assistant_text(sampled, id_prefix="call")


def tool_results(message: dict[str, Any], value: str = "391") -> list[dict[str, Any]]:
    return [{"role": "tool", "content": value, "tool_call_id": call["id"]} for call in message["tool_calls"]]


def formula(tok: Any, before: list[dict[str, Any]], output: list[int], after: list[dict[str, Any]],
            tools: Any = TOOLS) -> int:
    """The guide's count, computed here from the templates' text, independently of the counter."""
    def length(messages: list[dict[str, Any]]) -> int:
        return len(encode(tok, tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True)))
    return length(after) - (length(before) + len(output))


def test_canonical_tool_call_is_counted_exactly_without_drift(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    counter = ResponseMaskCounter(tok)
    first = counter.render(QUESTION, TOOLS)
    out, message = reply(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
                              '</tool_call>')
    assert isinstance(message["tool_calls"][0]["function"]["arguments"], str)
    counter.commit(first, out)
    messages = [*QUESTION, message, *tool_results(message)]
    n, drift = counter.count(counter.render(messages, TOOLS), call_index=1)
    tail = "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert n == len(encode(tok, tail)) == formula(tok, QUESTION, out, messages)
    assert drift is None, "the template re-renders the model's ids exactly"


def test_compact_json_with_string_arguments_follows_the_formula_and_reports_drift(qwen_tokenizer: Any) -> None:
    """The model spells its call compactly with whitespace around it; the server hands the call on with
    `arguments` as a JSON string, and the template re-renders it with spaces: the trainer's formula count
    is not the length of what follows the reply, and the buffer must send the formula's count."""
    tok = qwen_tokenizer
    counter = ResponseMaskCounter(tok)
    first = counter.render(QUESTION, TOOLS)
    sampled = ('\n <tool_call>\n{"arguments":{"expression":"17*23"},"name":"calculator"}\n</tool_call>\n'
               '<tool_call>\n{"name":"calculator","arguments":{"expression":"23*17"}}\n</tool_call>\n ')
    out, message = reply(tok, sampled)
    assert len(message["tool_calls"]) == 2
    counter.commit(first, out)
    messages = [*QUESTION, message, *tool_results(message)]
    second = counter.render(messages, TOOLS)
    n, drift = counter.count(second, call_index=1)
    assert n == formula(tok, QUESTION, out, messages)
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    rendered_reply_end = text.index("<|im_end|>", len(tok.apply_chat_template(
        QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True))) + len("<|im_end|>")
    tail = encode(tok, text[rendered_reply_end:])
    assert n != len(tail), "the re-rendered reply has another length than the model's ids"
    assert drift is not None and drift.region == "assistant" and drift.call_index == 1
    assert drift.offset == n - len(tail)
    assert drift.at >= len(first) and not drift.same_text and drift.tokens > 0
    assert '"arguments":{"expression":"17*23"}' in drift.held_text
    assert '"arguments": {"expression": "17*23"}' in drift.rendered_text


def test_reply_cut_by_length_counts_the_templates_end_of_turn_as_context(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    counter = ResponseMaskCounter(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to ten."}]
    first = counter.render(messages, None)
    out, message = reply(tok, "1, 2, 3, 4", closed=False)
    counter.commit(first, out)
    messages = [*messages, message, {"role": "user", "content": "Go on."}]
    n, drift = counter.count(counter.render(messages, None), call_index=1)
    tail = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert n == len(encode(tok, tail)) == formula(tok, messages[:2], out, messages, tools=None)
    assert drift is None


def test_template_that_drops_reasoning_makes_a_negative_count_an_error(qwen3_tokenizer: Any) -> None:
    tok = qwen3_tokenizer
    counter = ResponseMaskCounter(tok)
    first = counter.render(QUESTION, None)
    thinking = "Seventeen times twenty-three: 17 * 20 = 340, 17 * 3 = 51, so 340 + 51 = 391. " * 3
    out, message = reply(tok, f"<think>\n{thinking}\n</think>\n\nThe answer is \\boxed{{391}}")
    assert message.get("reasoning_content")
    counter.commit(first, out)
    messages = [*QUESTION, message, {"role": "user", "content": "Thanks."}]
    prompt = counter.render(messages, None)
    assert "Seventeen" not in tok.decode(prompt), "the template dropped the earlier reasoning"
    with pytest.raises(MaskCountError, match=r"response_mask count is -\d+") as caught:
        counter.count(prompt, call_index=1)
    assert caught.value.reason == "negative_count"
    assert "re-renders differently" in str(caught.value)


def test_earlier_prompt_rendered_differently_is_context_drift(qwen3_tokenizer: Any) -> None:
    """Qwen3 keeps reasoning only after the last user query: a new user turn after a tool round drops the
    reasoning inside the previous prompt itself."""
    tok = qwen3_tokenizer
    counter = ResponseMaskCounter(tok)
    messages = list(QUESTION)
    out1, call = reply(tok, '<think>\nuse it\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
                            '{"expression": "17 * 23"}}\n</tool_call>')
    counter.commit(counter.render(messages, TOOLS), out1)
    messages += [call, *tool_results(call)]
    second = counter.render(messages, TOOLS)
    counter.count(second, call_index=1)
    out2, answer = reply(tok, "<think>\nok\n</think>\n\nThe answer is \\boxed{391}")
    counter.commit(second, out2)
    messages += [answer, {"role": "user", "content": "Thanks! Please also explain, step by step and in full "
                                                     "sentences, how you used the calculator to get there."}]
    third = counter.render(messages, TOOLS)
    n, drift = counter.count(third, call_index=2)
    assert n == len(third) - len(second) - len(out2) and n > 0
    assert drift is not None and drift.region == "context" and drift.at < len(second)
    assert "use it" in drift.held_text and "use it" not in drift.rendered_text


def test_answer_without_token_ids_leaves_no_count(qwen_tokenizer: Any) -> None:
    counter = ResponseMaskCounter(qwen_tokenizer)
    counter.commit(counter.render(QUESTION, None), None)
    with pytest.raises(MaskCountError, match="token_ids") as caught:
        counter.count(counter.render([*QUESTION, {"role": "assistant", "content": "391"},
                                      {"role": "user", "content": "Sure?"}], None), call_index=1)
    assert caught.value.reason == "no_token_ids"


def test_common_prefix_and_difference_bounds() -> None:
    base = list(range(5000))
    for at in (0, 1, 1023, 1024, 1025, 3000, 4999):
        changed = base[:at] + [-1] + base[at + 1:]
        assert common_prefix(base, changed) == at
    assert common_prefix(base, base[:2500]) == 2500
    eot = -9
    small = measure_drift(1, [1, 2, 3], [4, 5, eot], [1, 2, 3, 4, 6, 7, eot, 8], eot, str)
    assert small is not None and (small.at, small.tokens, small.offset) == (4, 3, 1)
    big_held = list(range(DIFF_LIMIT + 10)) + [eot]
    big = measure_drift(1, [0], big_held, [0, -1, *big_held[1:], 8], eot, str)
    assert big is not None and big.tokens == len(big_held) and big.offset == 0
    tally = DriftTally()
    for drift in (None, small, big):
        tally.add(drift)
    assert tally.as_dict()["counted_calls"] == 3 and tally.drift_calls == 2
    assert tally.drift_tokens == small.tokens + big.tokens and tally.as_dict()["first_drift"]["at"] == 4


@pytest.mark.parametrize("shape", ["top", "choice"])
def test_token_ids_are_read_in_both_shapes(shape: str) -> None:
    choice: dict[str, Any] = {"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
                              "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}
    answer: dict[str, Any] = {"choices": [choice], "prompt_token_ids": [1, 2]}
    (answer if shape == "top" else choice)["token_ids"] = [7, 8]
    assert token_ids_of(answer) == ([1, 2], [7, 8], [-0.5, -0.25])
    assert token_ids_of({"choices": [{"message": {}}], "prompt_token_ids": [1]}) is None
