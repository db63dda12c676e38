"""The sample-building benchmark's inputs and baseline are what it claims: real token turns, no forks,
and slime's per-prefix baseline equal to the message path."""

from __future__ import annotations

from typing import Any

from bench.sample_building import make_trajectories, naive_prompt_response
from slime_adapter.build import build_samples


def test_baseline_matches_the_message_path_and_turns_do_not_fork(qwen_tokenizer: Any) -> None:
    with_turns, without = make_trajectories(3, seed=1)
    assert len({r["messages"][1]["content"] for r in without}) == 3, "distinct conversations"
    for turned, plain in zip(with_turns, without):
        assert sum(m["role"] == "assistant" for m in plain["messages"]) == len(turned["turns"]) == 4
        (token_sample,), stats = build_samples(turned, lambda: None, "qwen")
        assert stats.forks == 0 and token_sample.metadata["mask_source"] == "tokens"
        (message_sample,), _ = build_samples(plain, lambda: qwen_tokenizer, "qwen")
        prompt, response, mask = naive_prompt_response(qwen_tokenizer, plain["messages"], plain["tools"])
        assert message_sample.tokens == prompt + response and message_sample.loss_mask == mask
        # the engine's ids end at <|im_end|>; the template's rendering adds the newline after it
        assert token_sample.tokens == message_sample.tokens[:-1]
        assert token_sample.loss_mask == message_sample.loss_mask[:-1] and message_sample.loss_mask[-1] == 0
