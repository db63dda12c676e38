"""A generated corpus through the adapter, for every built-in template: nothing raises, ids equal the chat
template's, every non-edge token's mask follows the character-span rule computed here independently, and
edge tokens are counted exactly.

The corpus is seeded and deterministic: system prompts, whitespace at the edges of assistant text
(leading/trailing "\\n", " ", "\\n\\n", tabs), OpenAI tool calls (1-2 per turn, `arguments` a JSON string)
with `role="tool"` results, reasoning, unicode (CJK, emoji, combining marks), `step_loss_mask`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from slime_adapter.samples.build import build_samples

SEED = 1729
CONVERSATIONS = 240
# template flavour of load_qwen_tokenizer -> loss mask type
TYPES = {"qwen2.5": "qwen", "qwen3": "qwen3", "qwen3.5": "qwen3_5", "r1_distill": "distill_qwen"}

EDGES = ["", "", "\n", " ", "\n\n", "\t", " \n", "\n\t", "\t\n\n", "  ", "\n \n"]
WORDS = ["the", "answer", "is", "84", "Goethe", "wrote", "Faust", "—", "naïve", "café", "日本語", "のテキスト",
         "中文", "🎉", "🙂", "👩\u200d💻", "e\u0301", "a\u0308", "x²", "(ok)", "**bold**", "`code`", "1.5", "\\boxed{7}"]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calc", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "filters": {"type": "object"}, "limit": {"type": "integer"}},
                       "required": ["query"]}}},
]


def _text(rng: random.Random, lo: int = 1, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _edged(rng: random.Random, body: str) -> str:
    return rng.choice(EDGES) + body + rng.choice(EDGES)


def _arguments(rng: random.Random, name: str) -> str:
    """OpenAI's shape: a JSON string, as different clients serialise it."""
    if name == "calc":
        value: dict[str, Any] = {"expr": f"{rng.randint(1, 99)}*{rng.randint(1, 99)}"}
    else:
        value = {"query": _text(rng, 1, 4)}
        if rng.random() < 0.4:
            value["filters"] = {"lang": rng.choice(["en", "ja", "zh"]), "safe": rng.random() < 0.5}
        if rng.random() < 0.4:
            value["limit"] = rng.randint(1, 9)
    compact = rng.random() < 0.3
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=(",", ":") if compact else None)


def _assistant(rng: random.Random, calls: int, call_ids: Iterator[int]) -> dict[str, Any]:
    roll = rng.random()
    if calls and roll < 0.25:
        content: str | None = None
    elif calls and roll < 0.4:
        content = rng.choice(["", " ", "\n"])
    else:
        content = _edged(rng, _text(rng))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = rng.random()
    if content is not None and reasoning < 0.15:
        message["content"] = f"<think>\n{_text(rng)}\n</think>\n\n{content}"
    elif reasoning < 0.25:
        message["reasoning_content"] = _edged(rng, _text(rng))
    if calls:
        message["tool_calls"] = []
        for _ in range(calls):
            name = rng.choice(["calc", "search"])
            message["tool_calls"].append({"id": f"call_{next(call_ids)}", "type": "function",
                                          "function": {"name": name, "arguments": _arguments(rng, name)}})
    if rng.random() < 0.1:
        message["step_loss_mask"] = 0
    return message


def make_conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """One conversation (messages, tools): optional system prompt, 1-3 user turns, each answered after
    0-2 tool rounds of 1-2 calls; sometimes it ends on tool results."""
    tools = TOOLS if rng.random() < 0.6 else None
    call_ids = iter(range(10**6))
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": _edged(rng, "You are precise. " + _text(rng, 0, 4))})
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _edged(rng, _text(rng)) + "?"})
        for _ in range(rng.randint(0, 2) if tools else 0):
            calls = rng.randint(1, 2)
            messages.append(_assistant(rng, calls, call_ids))
            for call in messages[-1]["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _edged(rng, _text(rng, 1, 4))})
        if messages[-1]["role"] == "tool" and rng.random() < 0.08:
            break  # the conversation ends on tool results
        messages.append(_assistant(rng, 0, call_ids))
    return messages, tools


def corpus() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    rng = random.Random(SEED)
    return [make_conversation(rng) for _ in range(CONVERSATIONS)]


def _prepared(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """What SGLang hands a Qwen3.5 template: tool-call arguments parsed into mappings."""
    if kind != "qwen3_5":
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def generated_spans(text: str, kind: str) -> list[tuple[int, int]]:
    """Each assistant message's generated characters, found with a regex over the rendering (not with the
    adapter's locators): ChatML assistant blocks through `<|im_end|>` (after Qwen3.5's `<think>\\n`), or
    R1's assistant/tool-outputs openers through `<｜end▁of▁sentence｜>`."""
    spans = []
    if kind == "distill_qwen":
        for m in re.finditer(r"(?:<｜Assistant｜>|<｜tool▁outputs▁end｜>)(.*?)<｜end▁of▁sentence｜>", text, re.S):
            spans.append((m.start(1), m.end()))
        return spans
    for m in re.finditer(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.S):
        start = m.start(1)
        if kind == "qwen3_5" and m.group(1).startswith("<think>\n"):
            start += len("<think>\n")
        spans.append((start, m.end()))
    return spans


def expected_mask(tok: Any, text: str, spans: list[tuple[int, int]], trained: list[bool]
                  ) -> tuple[list[int], list[int], list[bool], int]:
    """ids, the character rule's mask per token, which tokens are edge tokens, and the response start:
    a token is 1 iff all its characters are in a trained span, an edge token iff only some are."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    generated = bytearray(len(text))
    for (a, b), train in zip(spans, trained):
        if train:
            generated[a:b] = b"\x01" * (b - a)
    mask, edge = [], []
    for s, e in enc["offset_mapping"]:
        assert e > s, "real Qwen offsets are never empty"
        inside = sum(generated[s:e])
        mask.append(1 if inside == e - s else 0)
        edge.append(0 < inside < e - s)
    first = spans[0][0] if spans else len(text)
    response_start = next((t for t, (s, _) in enumerate(enc["offset_mapping"]) if s >= first), len(mask))
    return list(enc["input_ids"]), mask, edge, response_start


@pytest.fixture(scope="module")
def conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    return corpus()


def test_corpus_is_deterministic_and_has_what_it_promises(conversations: list[Any]) -> None:
    assert corpus() == conversations, "seeded: the same corpus every run"
    assistants = [m for messages, _ in conversations for m in messages if m["role"] == "assistant"]
    texts = [m["content"] or "" for m in assistants]
    assert sum(t[:1] in "\n \t" and t != "" for t in texts) > 50, "leading whitespace"
    assert sum(t[-1:] in "\n \t" and t != "" for t in texts) > 50, "trailing whitespace"
    assert any(t.startswith("\n\n") for t in texts) and any("\t" in t for t in texts)
    calls = [m["tool_calls"] for m in assistants if m.get("tool_calls")]
    assert {len(c) for c in calls} == {1, 2}
    assert all(isinstance(c["function"]["arguments"], str) and c["type"] == "function" and c["id"]
               for cs in calls for c in cs)
    assert any(m["role"] == "tool" for messages, _ in conversations for m in messages)
    assert any(messages[0]["role"] == "system" for messages, _ in conversations)
    everything = json.dumps(conversations, ensure_ascii=False)
    assert all(ch in everything for ch in ("日", "🎉", "\u0301", "\u200d"))
    assert any(m.get("step_loss_mask") == 0 for m in assistants)


@pytest.mark.parametrize("flavour", sorted(TYPES))
def test_corpus_through_the_adapter(flavour: str, conversations: list[Any]) -> None:
    kind = TYPES[flavour]
    tok = load_qwen_tokenizer(flavour)
    edges_total = edges_in_response = 0
    for i, (messages, tools) in enumerate(conversations):
        record = {"uid": f"c{i}", "instance_id": str(i), "messages": messages, "tools": tools, "reward": 1.0,
                  "extra_info": {}}
        verify = "full" if i % 10 == 0 else "cheap"
        (sample,), stats = build_samples(record, lambda: tok, kind, verify=verify)
        assert "mask_refused" not in sample.metadata, (i, sample.metadata.get("mask_refused"))
        prepared = _prepared(messages, kind)
        reference = list(tok.apply_chat_template(prepared, tools=tools, tokenize=True, return_dict=False))
        assert sample.tokens == reference, i
        text = tok.apply_chat_template(prepared, tools=tools, tokenize=False)
        spans = generated_spans(text, kind)
        assistants = [m for m in messages if m["role"] == "assistant"]
        assert len(spans) == len(assistants), i
        trained = [m.get("step_loss_mask", 1) == 1 for m in assistants]
        ids, mask, edge, start = expected_mask(tok, text, spans, trained)
        assert ids == reference
        assert sample.response_length == len(ids) - start >= 1 and len(sample.loss_mask) == sample.response_length
        for t in range(start, len(ids)):
            if edge[t]:
                assert sample.loss_mask[t - start] == 0, (i, t)
            else:
                assert sample.loss_mask[t - start] == mask[t], (i, t)
        assert sample.metadata["mask_edge_tokens"] == sum(edge) == stats.mask_edge_tokens, i
        assert stats.mask_refused == 0 and stats.generated_tokens == sum(sample.loss_mask)
        edges_total += sum(edge)
        edges_in_response += sum(edge[start:])
    assert edges_total > 0 and edges_in_response > 0, "the corpus exercises edge tokens in prompt and response"
