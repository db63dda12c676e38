"""Shared pytest fixtures."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """The real Qwen2.5 fast tokenizer (built offline once per machine)."""
    return load_qwen_tokenizer("qwen2.5")


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """The real Qwen3 fast tokenizer, with <think> and <tool_response> added tokens."""
    return load_qwen_tokenizer("qwen3")


@pytest.fixture(scope="session")
def r1_tokenizer() -> Any:
    """The DeepSeek-R1-Distill-Qwen tokenizer (Qwen vocabulary, R1 markers)."""
    return load_qwen_tokenizer("r1_distill")
