"""The compiled ChatML renderer against the real Jinja template: same text and same tokens on the loss-mask
corpus (tools, tool calls with string `arguments`, whitespace at turn edges, `<think>`), refused where it
was not proven, and never used for a template that differs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from slime_adapter.masks.chatml_render import verified_renderer
from slime_adapter.masks.loss_mask import MultiTurnLossMaskGenerator
from tests.adapter.test_loss_mask_corpus import corpus


@pytest.fixture(scope="module")
def qwen25() -> Any:
    return load_qwen_tokenizer("qwen2.5")


def test_compiled_text_and_tokens_equal_the_jinja_template_on_the_corpus(qwen25: Any) -> None:
    renderer = verified_renderer(qwen25)
    assert renderer is not None, "the Qwen2.5 ChatML template is proven at start-up"
    conversations = corpus()
    features = {"tools": 0, "string_arguments": 0, "edge_whitespace": 0, "think": 0}
    for messages, tools in conversations:
        text = renderer.render(messages, tools)
        jinja = qwen25.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
        assert text == jinja
        ids = qwen25(text, add_special_tokens=False)["input_ids"]
        assert ids == qwen25.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        features["tools"] += bool(tools)
        calls = [c for m in messages for c in m.get("tool_calls") or []]
        features["string_arguments"] += any(isinstance(c["function"]["arguments"], str) for c in calls)
        contents = [m["content"] or "" for m in messages if m["role"] == "assistant"]
        features["edge_whitespace"] += any(c[:1].isspace() or c[-1:].isspace() for c in contents)
        features["think"] += any("<think>" in c for c in contents)
    assert all(count >= 10 for count in features.values()), features


def test_the_generator_renders_with_it_and_gets_the_same_ids(qwen25: Any) -> None:
    compiled = MultiTurnLossMaskGenerator(qwen25, "qwen")
    jinja = MultiTurnLossMaskGenerator(qwen25, "qwen", compiled_render=False)
    assert compiled.compiled is not None and jinja.compiled is None
    for messages, tools in corpus()[:60]:
        assert compiled.get_loss_mask(messages, tools) == jinja.get_loss_mask(messages, tools)


@pytest.mark.parametrize("flavour", ["qwen3", "r1_distill", "qwen3.5"])
def test_other_templates_keep_jinja(flavour: str) -> None:
    assert verified_renderer(load_qwen_tokenizer(flavour)) is None


def test_a_template_that_differs_is_not_compiled(qwen25: Any) -> None:
    changed = copy.deepcopy(qwen25)
    changed.chat_template = qwen25.chat_template.replace("<tool_response>\\n", "<tool_response>")
    assert changed.chat_template != qwen25.chat_template
    assert verified_renderer(changed) is None
    assert MultiTurnLossMaskGenerator(changed, "qwen").compiled is None


def test_a_template_changed_after_start_up_is_rendered_by_jinja(qwen25: Any) -> None:
    tok = copy.deepcopy(qwen25)
    generator = MultiTurnLossMaskGenerator(tok, "qwen")
    assert generator.compiled is not None
    tok.chat_template = tok.chat_template.replace("You are Qwen", "You are Q")
    text = generator.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text.startswith("<|im_start|>system\nYou are Q, created")


def test_input_outside_the_proof_goes_to_jinja(qwen25: Any) -> None:
    renderer = verified_renderer(qwen25)
    assert renderer is not None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "ok"}]
    assert renderer.render(parts) is None
    assert renderer.render([{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": 1}}]}]) is None
    generator = MultiTurnLossMaskGenerator(qwen25, "qwen")
    assert generator.render(parts) == qwen25.apply_chat_template(parts, tokenize=False)
