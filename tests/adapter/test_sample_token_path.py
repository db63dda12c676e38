"""Token path: samples built from the engine's own ids survive exactly, forks on drift, no tokenizer use."""

from __future__ import annotations

from typing import Any

import pytest

from slime_adapter.samples.build import build_samples
from slime_adapter.samples.sample import Sample, make_sample, sample_field_names, status_from_record
from slime_adapter.samples.token_path import build_token_pieces

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "Say hello, then add 2 and 3."}


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _split_ids(tok: Any, word: str, cut: int) -> list[int]:
    """Ids of `word` as two separately encoded halves: a sampling the merges would never produce."""
    return _ids(tok, word[:cut]) + _ids(tok, word[cut:])


def _byte_ids(tok: Any, char: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `char` (byte-level BPE alphabet)."""
    (merged,) = tok.convert_ids_to_tokens(_ids(tok, char))
    return tok.convert_tokens_to_ids(list(merged))


def _logprobs(n: int, base: float) -> list[float]:
    return [-(base + 0.01 * i) for i in range(n)]


def _prompt(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)


@pytest.fixture()
def drifting_turns(qwen_tokenizer: Any) -> dict[str, Any]:
    """Two turns whose outputs contain ids that decode->encode would change."""
    tok = qwen_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out1 = _split_ids(tok, "Hello", 2) + _byte_ids(tok, "é") + _ids(tok, " there") + [im_end]
    prompt1 = _prompt(tok, [SYSTEM, USER])
    tail = _ids(tok, "\n<|im_start|>user\nNow add 2 and 3.<|im_end|>\n<|im_start|>assistant\n")
    out2 = _split_ids(tok, "Five", 1) + _ids(tok, ".") + [im_end]
    prompt2 = prompt1 + out1 + tail
    turns = [
        {"prompt_ids": prompt1, "output_ids": out1, "output_logprobs": _logprobs(len(out1), 0.1), "finish_reason": "stop", "weight_version": "3"},
        {"prompt_ids": prompt2, "output_ids": out2, "output_logprobs": _logprobs(len(out2), 0.5), "finish_reason": "stop", "weight_version": "4"},
    ]
    return {"turns": turns, "tail": tail, "out1": out1, "out2": out2, "prompt1": prompt1}


def test_chosen_outputs_do_not_round_trip(qwen_tokenizer: Any, drifting_turns: dict[str, Any]) -> None:
    tok = qwen_tokenizer
    for key in ("out1", "out2"):
        ids = drifting_turns[key]
        assert tok.encode(tok.decode(ids), add_special_tokens=False) != ids


def test_token_path_keeps_exact_ids_masks_and_logprobs(drifting_turns: dict[str, Any]) -> None:
    turns, tail = drifting_turns["turns"], drifting_turns["tail"]
    out1, out2, prompt1 = drifting_turns["out1"], drifting_turns["out2"], drifting_turns["prompt1"]
    result = build_token_pieces(turns)
    assert result.forks == 0
    (piece,) = result.pieces
    assert piece.tokens == prompt1 + out1 + tail + out2
    assert piece.prompt_length == len(prompt1)
    assert piece.response_length == len(out1) + len(tail) + len(out2)
    assert piece.loss_mask == [1] * len(out1) + [0] * len(tail) + [1] * len(out2)
    assert piece.rollout_log_probs == turns[0]["output_logprobs"] + [0.0] * len(tail) + turns[1]["output_logprobs"]
    assert len(piece.loss_mask) == piece.response_length == len(piece.rollout_log_probs)
    assert piece.stats() == {
        "prompt_tokens": len(prompt1),
        "response_tokens": piece.response_length,
        "generated_tokens": len(out1) + len(out2),
        "turns": 2,
    }
    assert piece.weight_versions == ["3", "4"]


def test_fork_when_a_prompt_does_not_extend_history(qwen_tokenizer: Any, drifting_turns: dict[str, Any]) -> None:
    tok = qwen_tokenizer
    turns = list(drifting_turns["turns"])
    held = turns[1]["prompt_ids"] + turns[1]["output_ids"]
    # a worker that re-rendered the history from text: the split ids come back merged
    rerendered = tok.encode(tok.decode(held), add_special_tokens=False) + _ids(tok, "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert rerendered[: len(held)] != held
    out3 = _ids(tok, "You are welcome.") + [tok.convert_tokens_to_ids("<|im_end|>")]
    turns.append({"prompt_ids": rerendered, "output_ids": out3, "output_logprobs": None, "finish_reason": "stop"})
    result = build_token_pieces(turns)
    assert result.forks == 1
    first, second = result.pieces
    assert first.tokens == held and first.last_turn == 1
    assert second.tokens == rerendered + out3
    assert second.prompt_length == len(rerendered) and second.first_turn == 2
    assert second.loss_mask == [1] * len(out3)
    assert second.rollout_log_probs is None  # its only turn had no logprobs
    assert first.rollout_log_probs is not None


def test_missing_logprobs_anywhere_drops_them_for_the_piece(drifting_turns: dict[str, Any]) -> None:
    turns = [dict(t) for t in drifting_turns["turns"]]
    turns[1]["output_logprobs"] = None
    (piece,) = build_token_pieces(turns).pieces
    assert piece.rollout_log_probs is None
    assert len(piece.loss_mask) == piece.response_length


def test_turn_with_wrong_logprob_count_is_rejected(drifting_turns: dict[str, Any]) -> None:
    turns = [dict(t) for t in drifting_turns["turns"]]
    turns[0]["output_logprobs"] = turns[0]["output_logprobs"][:-1]
    with pytest.raises(ValueError, match="output_logprobs"):
        build_token_pieces(turns)
    with pytest.raises(ValueError):
        build_token_pieces([])


def test_build_samples_token_path_never_calls_a_tokenizer(drifting_turns: dict[str, Any]) -> None:
    def no_tokenizer() -> Any:
        raise AssertionError("token path must not load a tokenizer")

    turns = drifting_turns["turns"]
    record = {
        "uid": "u-1",
        "instance_id": "17",
        "messages": [SYSTEM, USER, {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Now add 2 and 3."}, {"role": "assistant", "content": "Five."}],
        "reward": 1.0,
        "extra_info": {"source": "unit"},
        "status": "completed",
        "turns": turns,
    }
    samples, stats = build_samples(record, no_tokenizer, "qwen")
    (sample,) = samples
    assert isinstance(sample, Sample)
    assert sample.tokens[: len(drifting_turns["prompt1"])] == drifting_turns["prompt1"]
    assert sample.metadata["mask_source"] == "tokens"
    assert sample.metadata["weight_version"] == "4"
    assert sample.metadata["source"] == "unit" and sample.metadata["raw_reward"] == 1.0
    assert sample.index == 17 and sample.prompt == "u-1"
    assert sample.status == Sample.Status.COMPLETED
    assert sample.response == "Hello there\nFive."
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    assert stats.token_path_records == 1 and stats.retokenized_records == 0
    assert stats.generated_tokens == sum(sample.loss_mask)


def test_status_mapping_and_sample_fields() -> None:
    assert status_from_record("completed") == Sample.Status.COMPLETED
    assert status_from_record("truncated") == Sample.Status.TRUNCATED
    assert status_from_record("aborted") == Sample.Status.ABORTED
    assert status_from_record("failed").name in {"FAILED", "ABORTED"}
    with pytest.raises(ValueError):
        status_from_record("done")
    names = sample_field_names()
    assert {"index", "prompt", "tokens", "response_length", "reward", "loss_mask", "rollout_log_probs", "status", "metadata", "label", "response"} <= names
    sample = make_sample(tokens=[1, 2], response_length=1, loss_mask=[1], status=Sample.Status.ABORTED)
    assert sample.to_dict()["status"] == "aborted"
    with pytest.raises(TypeError):
        make_sample(not_a_field=1)


def test_mask_offpolicy_trains_only_the_newest_versions_tokens() -> None:
    """slime's --mask-offpolicy-in-partial-rollout on the token path: tokens a newer policy version did not
    generate get mask 0, per token where a turn was aborted and continued (version_spans)."""
    from slime_adapter.samples.token_path import build_token_pieces

    turns = [
        {"prompt_ids": [1, 2], "output_ids": [3, 4], "weight_version": "3"},
        {"prompt_ids": [1, 2, 3, 4, 9], "output_ids": [5, 6, 7], "weight_version": 3, "version_spans": [[3, 1], [4, 2]]},
        {"prompt_ids": [1, 2, 3, 4, 9, 5, 6, 7, 9], "output_ids": [8], "weight_version": "default"},
    ]
    (plain,) = build_token_pieces(turns).pieces
    (masked,) = build_token_pieces(turns, mask_offpolicy=True).pieces
    assert plain.loss_mask == [1, 1, 0, 1, 1, 1, 0, 1]
    assert masked.loss_mask == [0, 0, 0, 0, 1, 1, 0, 1], "v3 tokens masked; a version label is not a version"
    assert masked.offpolicy_masked == 3 and masked.tokens == plain.tokens
    (same,) = build_token_pieces(turns[:1], mask_offpolicy=True).pieces
    assert same.loss_mask == [1, 1] and same.offpolicy_masked == 0, "one version: nothing is off-policy"
