"""Batch samples into padded arrays (SkyRL's layout) for trainers that want dense tensors.

Every row is left-padded so all sequences end at the row end; response-level arrays have the width of
the longest response and are right-aligned too, so position j of a response array is sequence position
`L - R + j` in every row. Rows are padded to the longest prompt+response of any one sample, which is
much shorter than longest-prompt plus longest-response when the two are anti-correlated.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["CollatableSample", "collate", "extract_response"]


class CollatableSample(Protocol):
    """What `collate` reads from a sample (slime's `Sample` and the stand-in both qualify)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int] | None
    rollout_log_probs: list[float] | None
    reward: Any


def _reward_value(sample: CollatableSample, reward_key: str | None) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        if reward_key is None:
            raise TypeError("sample reward is a dict; pass reward_key to pick the scalar to train on")
        reward = reward[reward_key]
    if reward is None:
        raise ValueError("sample has no reward")
    return float(reward)


def _check(sample: CollatableSample, i: int) -> None:
    r = sample.response_length
    if not 0 <= r <= len(sample.tokens):
        raise ValueError(f"sample {i}: response_length {r} outside 0..{len(sample.tokens)}")
    if sample.loss_mask is not None and len(sample.loss_mask) != r:
        raise ValueError(f"sample {i}: loss_mask has {len(sample.loss_mask)} values for response_length {r}")
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != r:
        raise ValueError(f"sample {i}: rollout_log_probs has {len(sample.rollout_log_probs)} values for response_length {r}")


def collate(
    samples: Sequence[CollatableSample],
    pad_token_id: int,
    max_seq_len: int | None = None,
    *,
    reward_key: str | None = None,
    as_torch: bool = False,
) -> dict[str, Any]:
    """Pad `samples` into one batch.

    Returns `input_ids`, `attention_mask` [B, L] (L = max over samples of prompt+response);
    `loss_mask`, `rollout_log_probs`, `rewards` [B, R] (R = max response length), right-aligned;
    `response_lengths` [B]; `has_rollout_log_probs` [B] (False rows carry zeros). `rewards` holds each
    sample's reward on its last response token. A sample longer than `max_seq_len` is warned about,
    never truncated (cutting would silently change what is trained on).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    for i, sample in enumerate(samples):
        _check(sample, i)
    batch = len(samples)
    seq_lens = [len(s.tokens) for s in samples]
    resp_lens = [s.response_length for s in samples]
    width = max(seq_lens)
    resp_width = max(resp_lens)
    if max_seq_len is not None:
        over = [i for i, n in enumerate(seq_lens) if n > max_seq_len]
        if over:
            warnings.warn(
                f"{len(over)} sample(s) exceed max_seq_len={max_seq_len} (longest {max(seq_lens[i] for i in over)} "
                f"tokens, rows {over[:8]}); not truncated",
                stacklevel=2,
            )

    input_ids = np.full((batch, width), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((batch, width), dtype=np.int64)
    loss_mask = np.zeros((batch, resp_width), dtype=np.int64)
    log_probs = np.zeros((batch, resp_width), dtype=np.float32)
    rewards = np.zeros((batch, resp_width), dtype=np.float32)
    has_log_probs = np.zeros(batch, dtype=bool)
    for i, sample in enumerate(samples):
        n, r = seq_lens[i], resp_lens[i]
        input_ids[i, width - n:] = sample.tokens
        attention_mask[i, width - n:] = 1
        reward = _reward_value(sample, reward_key)
        has_log_probs[i] = sample.rollout_log_probs is not None
        if r == 0:
            if reward != 0.0:
                warnings.warn(f"sample {i} has no response tokens; its reward {reward} has no token to sit on", stacklevel=2)
            continue
        start = resp_width - r
        loss_mask[i, start:] = sample.loss_mask if sample.loss_mask is not None else 1
        if sample.rollout_log_probs is not None:
            log_probs[i, start:] = sample.rollout_log_probs
        rewards[i, resp_width - 1] = reward

    out: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_log_probs": log_probs,
        "rewards": rewards,
        "response_lengths": np.asarray(resp_lens, dtype=np.int64),
        "has_rollout_log_probs": has_log_probs,
    }
    if as_torch:
        try:
            import torch
        except ImportError as exc:  # torch is optional for this package
            raise ImportError("collate(as_torch=True) needs torch installed") from exc
        out = {k: torch.from_numpy(v) for k, v in out.items()}
    return out


def extract_response(values_row: Sequence[Any] | np.ndarray, valid_len: int) -> Any:
    """The last `valid_len` entries of a right-aligned row (a sequence row or a response-array row).

    Spelled out instead of `row[-valid_len:]`, which would return the whole row for `valid_len == 0`.
    """
    if valid_len < 0 or valid_len > len(values_row):
        raise ValueError(f"valid_len {valid_len} outside 0..{len(values_row)}")
    return values_row[len(values_row) - valid_len:]
