"""Collation into SkyRL's left-padded layout: widths, alignment, extraction, warnings."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

from slime_adapter.samples.collate import collate, extract_response
from slime_adapter.samples.sample import Sample, make_sample

PAD = 151643


def _sample(prompt_len: int, response_len: int, reward: float, seed: int, with_logprobs: bool = True) -> Sample:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150000, size=prompt_len + response_len).tolist()
    mask = rng.integers(0, 2, size=response_len).tolist()
    logprobs = (-rng.random(response_len)).tolist() if with_logprobs else None
    return make_sample(
        tokens=tokens,
        response_length=response_len,
        loss_mask=mask,
        rollout_log_probs=logprobs,
        reward=reward,
        status=Sample.Status.COMPLETED,
    )


def _anti_correlated() -> list[Sample]:
    # long prompt + short response, short prompt + long response
    return [_sample(90, 10, 1.0, 1), _sample(10, 80, -0.5, 2), _sample(40, 40, 0.25, 3)]


def test_padded_length_is_max_sum_not_sum_of_maxes() -> None:
    samples = _anti_correlated()
    batch = collate(samples, pad_token_id=PAD)
    sums = [len(s.tokens) for s in samples]
    max_prompt = max(len(s.tokens) - s.response_length for s in samples)
    max_resp = max(s.response_length for s in samples)
    assert batch["input_ids"].shape == (3, max(sums))
    assert max(sums) < max_prompt + max_resp
    assert batch["loss_mask"].shape == (3, max_resp)
    assert batch["input_ids"].dtype == np.int64


def test_left_padding_and_attention_mask() -> None:
    samples = _anti_correlated()
    batch = collate(samples, pad_token_id=PAD)
    width = batch["input_ids"].shape[1]
    for i, s in enumerate(samples):
        n = len(s.tokens)
        assert batch["input_ids"][i, width - n:].tolist() == s.tokens
        assert (batch["input_ids"][i, : width - n] == PAD).all()
        assert batch["attention_mask"][i].sum() == n
        assert batch["attention_mask"][i, width - n:].all()


def test_right_aligned_extraction_recovers_each_response() -> None:
    samples = _anti_correlated()
    batch = collate(samples, pad_token_id=PAD)
    resp_width = batch["loss_mask"].shape[1]
    for i, s in enumerate(samples):
        r = int(batch["response_lengths"][i])
        assert r == s.response_length
        assert extract_response(batch["loss_mask"][i], r).tolist() == s.loss_mask
        np.testing.assert_allclose(extract_response(batch["rollout_log_probs"][i], r), s.rollout_log_probs, rtol=1e-6)
        # the response tokens of the sequence row sit at the same right-aligned positions
        assert extract_response(batch["input_ids"][i], r).tolist() == s.tokens[-r:]
        rewards = extract_response(batch["rewards"][i], r)
        assert rewards[-1] == pytest.approx(s.reward)
        assert not rewards[:-1].any()
        # padding before the response is zero in every response-level array
        assert not batch["loss_mask"][i, : resp_width - r].any()
        assert not batch["rollout_log_probs"][i, : resp_width - r].any()
    assert batch["has_rollout_log_probs"].all()


def test_extract_zero_length_is_empty() -> None:
    row = np.arange(5)
    assert extract_response(row, 0).tolist() == []
    assert extract_response(row, 2).tolist() == [3, 4]
    with pytest.raises(ValueError):
        extract_response(row, 6)


def test_max_seq_len_warns_without_truncating() -> None:
    samples = _anti_correlated()
    with pytest.warns(UserWarning, match="exceed max_seq_len=85"):
        batch = collate(samples, pad_token_id=PAD, max_seq_len=85)
    assert batch["input_ids"].shape[1] == 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collate(samples, pad_token_id=PAD, max_seq_len=100)


def test_missing_logprobs_and_length_mismatch() -> None:
    samples = [_sample(5, 4, 1.0, 7, with_logprobs=False), _sample(3, 6, 0.0, 8)]
    batch = collate(samples, pad_token_id=PAD)
    assert batch["has_rollout_log_probs"].tolist() == [False, True]
    assert not batch["rollout_log_probs"][0].any()
    bad = _sample(5, 4, 1.0, 9)
    bad.loss_mask = bad.loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        collate([bad], pad_token_id=PAD)


def test_as_torch_matches_availability() -> None:
    samples = _anti_correlated()
    if importlib.util.find_spec("torch") is None:
        with pytest.raises(ImportError, match="torch"):
            collate(samples, pad_token_id=PAD, as_torch=True)
    else:
        batch = collate(samples, pad_token_id=PAD, as_torch=True)
        assert tuple(batch["input_ids"].shape) == (3, 100)
