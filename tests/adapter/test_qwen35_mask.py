"""slime's `qwen3_5` loss mask type on a Qwen3.5-style template with the real Qwen tokenizer.

The conversations are the ones slime's own test (`tests/utils/test_loss_mask_type_qwen35.py`) uses for
the Qwen3.5 shape: think blocks only after the last user query, a generation prompt ending with
`<think>\\n` that the policy never generates, XML tool calls. Differences from slime's generator, by
design: the `\\n` after `<|im_end|>` is not trained (the engine stops at `<|im_end|>`), and a token that
merges template and generated characters is an edge token (mask 0, counted) instead of 1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from slime_adapter.masks.loss_mask import MultiTurnLossMaskGenerator
from slime_adapter.masks.span_locators import LossMaskError, Qwen35SpanLocator, normalize_tool_call_arguments


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_qwen_tokenizer("qwen3.5")


@pytest.fixture()
def gen(tok: Any) -> MultiTurnLossMaskGenerator:
    return MultiTurnLossMaskGenerator(tok, "qwen3_5", verify="full")


def _call(command: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "terminal", "arguments": json.dumps({"command": command})}}


def test_generation_prompt_is_the_prompt_and_think_opener_is_not_trained(tok: Any, gen: MultiTurnLossMaskGenerator) -> None:
    messages = [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "USER"},
                {"role": "assistant", "content": "<think>REASONING</think>\nANSWER"}]
    prompt, response, mask = gen.get_prompt_response(messages)
    engine_prompt = tok.apply_chat_template(messages[:2], tokenize=True, return_dict=False, add_generation_prompt=True)
    assert tok.decode(engine_prompt).endswith("<|im_start|>assistant\n<think>\n")
    assert prompt == engine_prompt, "the prompt is exactly what the engine was given"
    ids = prompt + response
    assert gen.get_text_from_loss_mask(ids, [0] * len(prompt) + mask) == ["REASONING\n</think>\n\nANSWER<|im_end|>"]
    assert mask[-1] == 0 and tok.decode(response[-1:]) == "\n", "the newline after <|im_end|> is template"
    assert gen.encode(messages).edge_tokens == 0


def test_answers_before_the_last_query_have_no_think_block(tok: Any, gen: MultiTurnLossMaskGenerator) -> None:
    messages = [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "USER_1"},
                {"role": "assistant", "content": "ANSWER_1"}, {"role": "user", "content": "USER_2"},
                {"role": "assistant", "content": "<think>REASONING_2</think>\nANSWER_2"}]
    ids, mask = gen.get_loss_mask(messages)
    assert gen.get_text_from_loss_mask(ids, mask) == ["ANSWER_1<|im_end|>", "REASONING_2\n</think>\n\nANSWER_2<|im_end|>"]
    text = tok.decode(ids)
    assert "<|im_start|>assistant\nANSWER_1<|im_end|>" in text and text.count("<think>") == 1


def test_tool_call_flow_with_empty_reasoning_has_one_edge_token(tok: Any, gen: MultiTurnLossMaskGenerator) -> None:
    """The first answer follows the last user query with no reasoning: `<think>\\n` (prompt) + `\\n</think>`
    (generated) tokenizes `\\n\\n` as one token, which is prompt and mask 0; the rest trains."""
    messages = [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "USER"},
                {"role": "assistant", "content": "TOOL_CALL", "tool_calls": [_call("ls")]},
                {"role": "tool", "content": "README.md"},
                {"role": "assistant", "content": "<think>REASONING</think>\nFINAL"}]
    encoded = gen.encode(messages)
    assert encoded.edge_tokens == 1
    (edge,) = encoded.spans.edges[0]
    assert tok.decode([encoded.ids[edge]]) == "\n\n" and encoded.mask[edge] == 0
    assert edge == encoded.response_start - 1, "the straddling token is the prompt's last token"
    assert gen.get_text_from_loss_mask(encoded.ids, encoded.mask) == [
        "</think>\n\nTOOL_CALL\n\n<tool_call>\n<function=terminal>\n<parameter=command>\nls\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        "REASONING\n</think>\n\nFINAL<|im_end|>",
    ]
    for k in (2, 4):  # each assistant span starts where the engine's prompt for that turn ended
        prefix = tok.apply_chat_template(normalize_tool_call_arguments(messages[:k]), tokenize=False,
                                         add_generation_prompt=True)
        text, spans = gen.get_text_and_spans(messages)
        assert text.startswith(prefix) and spans[k // 2 - 1].start == len(prefix)


def test_consecutive_tool_results_share_one_user_block(tok: Any, gen: MultiTurnLossMaskGenerator) -> None:
    messages = [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "USER"},
                {"role": "assistant", "content": "CALL", "tool_calls": [_call("cat a.py"), _call("cat b.py")]},
                {"role": "tool", "content": "CONTENTS_A"}, {"role": "tool", "content": "CONTENTS_B"}]
    ids, mask = gen.get_loss_mask(messages)
    text = tok.decode(ids)
    assert text.count("<|im_start|>user") == 2 and text.endswith("CONTENTS_B\n</tool_response><|im_end|>\n")
    (generated,) = gen.get_text_from_loss_mask(ids, mask)
    assert generated.count("<tool_call>") == 2 and generated.endswith("</tool_call><|im_end|>")


def test_arguments_are_parsed_as_sglang_does_without_touching_the_input() -> None:
    call = _call("ls -la")
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prepared = Qwen35SpanLocator().prepare_messages(messages)
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"command": "ls -la"}
    assert call["function"]["arguments"] == '{"command": "ls -la"}', "the record's messages are not changed"
    for bad in ('{"command": ', '["ls"]', '"ls"'):
        with pytest.raises(LossMaskError, match="not a JSON object"):
            normalize_tool_call_arguments([{"role": "assistant", "tool_calls": [{"function": {"name": "t", "arguments": bad}}]}])


def test_qwen35_tokenizer_is_the_qwen3_vocabulary_with_its_own_template(tok: Any) -> None:
    from rollout_buffer.testing.tokenizer import EXTRA_TEMPLATES, TEMPLATES, added_token_ids

    assert "qwen3.5" in EXTRA_TEMPLATES and "qwen3.5" not in TEMPLATES
    assert added_token_ids("qwen3.5") == added_token_ids("qwen3")
    qwen3 = load_qwen_tokenizer("qwen3")
    text = "<think>\nplain 日本語 🎉\n</think>\n\n<tool_call>"
    assert tok.encode(text, add_special_tokens=False) == qwen3.encode(text, add_special_tokens=False)
    messages = normalize_tool_call_arguments([
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "C", "tool_calls": [_call("ls")]}, {"role": "tool", "content": "R"}])
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True) == \
        tok.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n")
    thinking_off = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="qwen3.5"):
        load_qwen_tokenizer("qwen9")
