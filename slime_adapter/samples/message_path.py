"""The message path as the sample builder uses it: one conversation in, one trainable result out, never
an exception for bad input.

A conversation that is not a chat the template renders exactly (`MultiTurnLossMaskGenerator.encode`
refuses it, the template raises, there is no assistant message to train on) is still returned, as a
refused result: principle 2, one odd conversation never kills a training step. What slime does with
such a sample is checked against slime's own loss code; see `MessagePathSample`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_adapter.masks.loss_mask import MultiTurnLossMaskGenerator

__all__ = ["MessagePathSample", "build_message_path_sample", "placeholder_id"]

log = logging.getLogger(__name__)

#: longest refusal reason kept in a sample's metadata
REASON_CHARS = 300


@dataclass(frozen=True)
class MessagePathSample:
    """Prompt and response ids with the response's loss mask, the edge-token count, and `refused`: why
    the conversation was refused, or None.

    A refused conversation gets two placeholder ids (`placeholder_id`), prompt 1 and response 1, with loss
    mask `[0]`: it trains nothing. Why that shape: slime's `get_responses`
    (`slime/backends/megatron_utils/loss.py`) slices `tokens[-response_length:]` and
    `logits[start - 1:end - 1]`, so `response_length == 0` would take the whole sequence and a response
    without a prompt token before it would index before the sample; it needs `response_length >= 1` and
    one prompt token. The all-zero mask is safe there: `get_sum_of_sample_mean` (`cp_utils.py`) divides
    each sample's masked sum by `clamp_min(loss_mask.sum(), 1)`, so the sample adds exactly 0, never NaN,
    to the policy, KL and entropy terms, just as slime's own `remove_sample` samples do (slime zeroes their
    masks in `ray/rollout.py`). One limit is slime's, not the sample's: with `--normalize-advantages`, a
    step whose samples are *all* zero-masked makes `distributed_masked_whiten` raise ("global mask sum
    ... is zero"); one refused sample among trainable ones is harmless.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    edge_tokens: int = 0
    refused: str | None = None


def placeholder_id(tokenizer: Any) -> int:
    """The id a refused sample is made of: the tokenizer's pad id, else its eos id, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _refused(generator: MultiTurnLossMaskGenerator, reason: str) -> MessagePathSample:
    token = placeholder_id(generator.tokenizer)
    return MessagePathSample(prompt_ids=[token], response_ids=[token], loss_mask=[0],
                             refused=reason[:REASON_CHARS])


def build_message_path_sample(generator: MultiTurnLossMaskGenerator, messages: Sequence[dict[str, Any]],
                              tools: list[dict[str, Any]] | None, uid: str = "") -> MessagePathSample:
    """The conversation's prompt, response, mask and edge count; a refused result (logged with `uid`)
    for anything that is not a chat this template renders exactly, never an exception."""
    try:
        encoded = generator.encode(messages, tools)
    except Exception as exc:  # noqa: BLE001 - whatever the template or the checks refuse, the step goes on
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("message path refused record %s (kept with an all-zero loss mask): %s", uid, reason)
        return _refused(generator, reason)
    split = encoded.response_start
    if split >= len(encoded.ids):
        log.warning("message path refused record %s (kept with an all-zero loss mask): no assistant message", uid)
        return _refused(generator, "no assistant message: nothing the policy generated to train on")
    if split == 0:
        log.warning("message path refused record %s: its rendering has no prompt token", uid)
        return _refused(generator, "the rendering has no prompt token before the first assistant message")
    return MessagePathSample(prompt_ids=encoded.ids[:split], response_ids=encoded.ids[split:],
                             loss_mask=encoded.mask[split:], edge_tokens=encoded.edge_tokens)
