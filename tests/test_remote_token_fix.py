"""On-policy token fix (`rollout_buffer.remote.token_fix`), with the real Qwen tokenizers and the test engine's
chat endpoint."""

from __future__ import annotations

from typing import Any

import httpx

from rollout_buffer.chat_format import parse_assistant_text
from rollout_buffer.remote.token_fix import (
    TokenFixCounters,
    build_segments,
    end_of_turn_id,
    normalize_turn_text,
)
from rollout_buffer.testing.engine import run_engine_in_thread
from tests.remote_tasks.remote_calculator_generator import TOOLS


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None}


def _chat(client: httpx.Client, messages: list[dict[str, Any]], tools: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call with token ids; returns (assistant message, recorded turn)."""
    body: dict[str, Any] = {"messages": messages, "return_token_ids": True, "logprobs": True, "max_tokens": 256}
    if tools:
        body["tools"] = tools
    answer = client.post("/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    turn = {"prompt_ids": answer["prompt_token_ids"], "output_ids": choice["token_ids"],
            "output_logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "finish_reason": choice["finish_reason"], "weight_version": answer["metadata"]["weight_version"]}
    return _clean(choice["message"]), turn


def _check_lengths(segment: dict[str, Any]) -> None:
    assert len(segment["response_ids"]) == len(segment["response_mask"])
    if segment["response_logprobs"] is not None:
        assert len(segment["response_logprobs"]) == len(segment["response_ids"])


def _span_differs(turns: list[dict[str, Any]], eot: int) -> bool:
    """Whether the second prompt re-renders the first output with other ids (so a fix is needed)."""
    first, second = turns[0], turns[1]
    start = len(first["prompt_ids"])
    end = second["prompt_ids"].index(eot, start) + 1
    return second["prompt_ids"][start:end] != first["output_ids"]


def test_qwen3_tool_loop_splices_the_models_own_ids(qwen3_tokenizer: Any) -> None:
    eot = end_of_turn_id(qwen3_tokenizer)
    with run_engine_in_thread(template="qwen3", tokenizer=qwen3_tokenizer, seed=11, noise_tokens=(10, 16)) as engine:
        client = httpx.Client(base_url=engine.url, timeout=30)
        messages = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]
        first, turn1 = _chat(client, messages, TOOLS)
        assert first["tool_calls"] and first.get("reasoning_content") is not None
        messages += [first, {"role": "tool", "content": "84", "tool_call_id": first["tool_calls"][0]["id"]}]
        _, turn2 = _chat(client, messages, TOOLS)
    assert _span_differs([turn1, turn2], eot), "the re-rendered history must differ for this test to mean anything"
    counters = TokenFixCounters()
    segments = build_segments([turn1, turn2], qwen3_tokenizer, counters=counters)
    assert counters.spliced == 1 and counters.split == 0
    assert len(segments) == 1
    seg = segments[0]
    _check_lengths(seg)
    out1, out2 = turn1["output_ids"], turn2["output_ids"]
    assert seg["prompt_ids"] == turn1["prompt_ids"]
    assert seg["response_ids"][:len(out1)] == out1, "the model's exact ids of the first turn"
    assert seg["response_ids"][-len(out2):] == out2
    assert seg["response_mask"] == [1] * len(out1) + [0] * (len(seg["response_ids"]) - len(out1) - len(out2)) + [1] * len(out2)
    middle = seg["response_ids"][len(out1):-len(out2)]
    assert "<tool_response>\n84\n</tool_response>" in qwen3_tokenizer.decode(middle)
    assert seg["response_logprobs"][:len(out1)] == turn1["output_logprobs"]
    assert set(seg["response_logprobs"][len(out1):-len(out2)]) == {0.0}


def test_qwen3_new_user_turn_strips_reasoning_and_splits(qwen3_tokenizer: Any) -> None:
    with run_engine_in_thread(template="qwen3", tokenizer=qwen3_tokenizer, seed=5) as engine:
        client = httpx.Client(base_url=engine.url, timeout=30)
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        first, turn1 = _chat(client, messages)
        assert "<think>" in qwen3_tokenizer.decode(turn1["output_ids"])
        messages += [first, {"role": "user", "content": "And what is 5 * 6?"}]
        _, turn2 = _chat(client, messages)
    assert "<think>" not in qwen3_tokenizer.decode(turn2["prompt_ids"]), "the template dropped earlier reasoning"
    counters = TokenFixCounters()
    segments = build_segments([turn1, turn2], qwen3_tokenizer, counters=counters)
    assert counters.split == 1 and counters.split_reasons == {"assistant_rewritten": 1} and counters.spliced == 0
    assert [s["calls"] for s in segments] == [[0], [1]]
    for seg, turn in zip(segments, (turn1, turn2)):
        _check_lengths(seg)
        assert seg["prompt_ids"] == turn["prompt_ids"] and seg["response_ids"] == turn["output_ids"]
        assert seg["response_mask"] == [1] * len(turn["output_ids"])


def test_retemplated_tool_call_is_spliced_and_plain_history_is_exact(qwen_tokenizer: Any) -> None:
    tok, eot = qwen_tokenizer, end_of_turn_id(qwen_tokenizer)

    def render(messages: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    # The model spells its call compactly; the template re-renders it from parsed JSON with spaces.
    sampled = '<tool_call>\n{"name":"calculator","arguments":{"expression":"12*7"}}\n</tool_call>'
    out1 = tok.encode(sampled, add_special_tokens=False) + [eot]
    call = parse_assistant_text(sampled)
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    turn1 = {"prompt_ids": render(messages), "output_ids": out1, "output_logprobs": [-0.5] * len(out1)}
    messages += [call, {"role": "tool", "content": "84", "tool_call_id": call["tool_calls"][0]["id"]}]
    out2 = tok.encode("The answer is \\boxed{84}", add_special_tokens=False) + [eot]
    turn2 = {"prompt_ids": render(messages), "output_ids": out2, "output_logprobs": [-0.25] * len(out2)}
    messages += [parse_assistant_text("The answer is \\boxed{84}"), {"role": "user", "content": "Thanks!"}]
    out3 = tok.encode("You are welcome.", add_special_tokens=False) + [eot]
    turn3 = {"prompt_ids": render(messages), "output_ids": out3, "output_logprobs": None}
    assert _span_differs([turn1, turn2], eot)
    counters = TokenFixCounters()
    segments = build_segments([turn1, turn2, turn3], tok, counters=counters)
    assert len(segments) == 1 and segments[0]["calls"] == [0, 1, 2]
    # Call 2 needed the splice; call 3 re-renders turn 1 the same way again (still a splice), so both count.
    assert counters.spliced == 2 and counters.split == 0
    seg = segments[0]
    _check_lengths(seg)
    assert seg["response_ids"][:len(out1)] == out1
    assert seg["response_logprobs"] is None, "a call without logprobs makes the segment's logprobs unknown"
    ones = [i for i, m in enumerate(seg["response_mask"]) if m == 1]
    assert [seg["response_ids"][i] for i in ones] == out1 + out2 + out3
    # Exactness without drift: plain text turns re-render to the model's ids.
    plain = [{"role": "user", "content": "Hi"}]
    p1 = render(plain)
    o1 = tok.encode("Hello there.", add_special_tokens=False) + [eot]
    plain += [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"}]
    exact = TokenFixCounters()
    build_segments([{"prompt_ids": p1, "output_ids": o1}, {"prompt_ids": render(plain), "output_ids": o1}], tok,
                   counters=exact)
    assert (exact.exact, exact.spliced, exact.split) == (1, 0, 0)


def test_truncated_history_is_split_and_counted(qwen_tokenizer: Any) -> None:
    tok, eot = qwen_tokenizer, end_of_turn_id(qwen_tokenizer)

    def render(messages: list[dict[str, Any]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)

    def out(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + [eot]

    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": "One?"}]
    turns = [{"prompt_ids": render(history), "output_ids": out("1")}]
    history += [{"role": "assistant", "content": "1"}, {"role": "user", "content": "Two?"}]
    turns.append({"prompt_ids": render(history), "output_ids": out("2")})
    # The agent drops the oldest exchange to save context: not monotonic.
    history = [system, {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"},
               {"role": "user", "content": "Three?"}]
    turns.append({"prompt_ids": render(history), "output_ids": out("3")})
    counters = TokenFixCounters()
    segments = build_segments(turns, tok, counters=counters)
    assert counters.split == 1 and sum(counters.split_reasons.values()) == 1
    assert set(counters.split_reasons) <= {"context_changed", "truncated"}
    assert [s["calls"] for s in segments] == [[0, 1], [2]]
    assert segments[1]["prompt_ids"] == turns[2]["prompt_ids"]
    for seg in segments:
        _check_lengths(seg)
    # A length-cut turn (no end-of-turn sampled): the template's own closing token is context.
    cut = tok.encode("4 and", add_special_tokens=False)
    history_cut = [system, {"role": "user", "content": "Four?"}]
    length_turn = {"prompt_ids": render(history_cut), "output_ids": cut, "finish_reason": "length"}
    history_cut += [{"role": "assistant", "content": "4 and"}, {"role": "user", "content": "Go on."}]
    follow = {"prompt_ids": render(history_cut), "output_ids": out("so on")}
    (joined,) = build_segments([length_turn, follow], tok)
    _check_lengths(joined)
    assert joined["response_ids"][:len(cut)] == cut and joined["response_mask"][len(cut)] == 0
    assert joined["response_ids"][len(cut)] == eot, "the template's closing token, not the model's, is masked 0"


def test_normalize_turn_text_ignores_only_rendering_differences() -> None:
    a = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"b": 1, "a": 2}}\n</tool_call><|im_end|>'
    b = '<think>x</think><tool_call>{"arguments":{"a":2,"b":1},"name":"f"}</tool_call>'
    assert normalize_turn_text(a) == normalize_turn_text(b)
    assert normalize_turn_text("<think>x</think>answer") != normalize_turn_text("answer")
