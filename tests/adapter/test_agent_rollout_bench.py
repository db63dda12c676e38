"""The sample-building benchmark's inputs and baseline are what it claims: distinct conversations with real
token turns, no forks, and slime's per-message baseline giving the message path's tokens."""

from __future__ import annotations

from typing import Any

from bench.sample_building import PerMessageBaseline, make_trajectories
from slime_adapter.samples.build import build_samples


def test_baseline_matches_the_message_path_and_turns_do_not_fork(qwen_tokenizer: Any) -> None:
    with_turns, without = make_trajectories(3, seed=1)
    assert len({r["messages"][1]["content"] for r in without}) == 3, "distinct conversations"
    baseline = PerMessageBaseline(qwen_tokenizer)
    for turned, plain in zip(with_turns, without):
        assert sum(m["role"] == "assistant" for m in plain["messages"]) == len(turned["turns"]) == 4
        (token_sample,), stats = build_samples(turned, lambda: None, "qwen")
        assert stats.forks == 0 and token_sample.metadata["mask_source"] == "tokens"
        (message_sample,), _ = build_samples(plain, lambda: qwen_tokenizer, "qwen")
        prompt, response, mask = baseline.prompt_response(plain["messages"], plain["tools"])
        assert message_sample.tokens == prompt + response, "slime's per-message tokens are the template's"
        newline = qwen_tokenizer.convert_tokens_to_ids("Ċ")
        differs = [i for i, (a, b) in enumerate(zip(message_sample.loss_mask, mask)) if a != b]
        assert len(differs) == 4 and all(message_sample.tokens[len(prompt) + i] == newline for i in differs), \
            "the masks differ only on the newline after each <|im_end|>, which slime's trains"
        # the engine's ids end at <|im_end|>; the template's rendering adds the newline after it
        assert token_sample.tokens == message_sample.tokens[:-1]
        assert token_sample.loss_mask == message_sample.loss_mask[:-1] and message_sample.loss_mask[-1] == 0
