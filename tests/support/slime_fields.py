"""Checks of the Sample fields slime's trainer reads, written from slime's source as facts
(`slime/utils/types.py`: `Sample._apply_meta_info` appends `meta_info["weight_version"]` once per engine
call, adds `cached_tokens` / `prompt_tokens` to `prefix_cache_info` and `spec_*` / `completion_tokens` to
`spec_info`; routed experts are `(len(tokens) - 1, num_layers, topk)`; top-p offsets hold
`response_length + 1` values, empty spans for tokens the policy did not generate). Shared by the
always-on tests (the adapter's own Sample) and the tier that imports slime's real `Sample`."""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout_buffer.testing.engine.replay import expert_rows

__all__ = ["call_starts", "check_sample_fields", "filter_nonzero_std"]


def call_starts(sample: Any) -> list[int]:
    """Where each engine call's output starts in `sample.tokens` (runs of mask 1 in the response)."""
    prompt_len = len(sample.tokens) - sample.response_length
    mask = list(sample.loss_mask)
    return [prompt_len + i for i, bit in enumerate(mask) if bit and (i == 0 or not mask[i - 1])]


def check_sample_fields(sample: Any, *, engine_version: str, calls: int, spec_draft: int, moe: tuple[int, int, int],
                        vocab: int, min_tool_s: float, stamped: bool = True) -> None:
    """Every field of item 1 on one token-path sample of a run on the test engine (replay fields on).
    `stamped`: the run has a policy version (a trainer said one), so every turn carries the counter."""
    starts = call_starts(sample)
    assert len(starts) == calls, (starts, calls)
    assert sample.weight_versions == [engine_version] * calls, "one engine weight_version string per call"
    if stamped:
        assert isinstance(sample.metadata["policy_version"], int), "the buffer's policy counter stays in metadata"
        assert all(isinstance(v, int) for v in sample.metadata["policy_versions"])
    assert isinstance(sample.rollout_id, int)
    assert sample.session_id == sample.metadata["uid"], "the runtime's routing key"
    prefix = sample.prefix_cache_info
    assert prefix.total_prompt_tokens == sum(starts), "prompt_tokens of every call"
    assert prefix.cached_tokens >= starts[0] if calls > 1 else prefix.cached_tokens >= 0, \
        "a later turn's prompt extends the first call's, which the engine's prefix cache holds"
    outputs = int(sum(sample.loss_mask))
    spec = sample.spec_info
    assert spec.completion_token_num == outputs
    assert spec.spec_draft_token_num == spec.spec_verify_ct * spec_draft and spec.spec_verify_ct > 0
    layers, topk, experts = moe
    assert "routed_experts_problem" not in sample.metadata, sample.metadata.get("routed_experts_problem")
    routed = np.asarray(sample.rollout_routed_experts)
    assert routed.shape == (len(sample.tokens) - 1, layers, topk)
    assert np.array_equal(routed, expert_rows(list(sample.tokens[:-1]), layers, topk, experts)), \
        "rows joined across turns are the engine's routing of every token but the last"
    offsets = list(np.asarray(sample.rollout_top_p_token_offsets))
    ids = list(np.asarray(sample.rollout_top_p_token_ids))
    assert len(offsets) == sample.response_length + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    prompt_len = len(sample.tokens) - sample.response_length
    for i, bit in enumerate(sample.loss_mask):
        span = ids[offsets[i]:offsets[i + 1]]
        token = int(sample.tokens[prompt_len + i])
        assert span == ([token, (token + 1) % vocab] if bit else []), (i, span)
    assert sample.non_generation_time >= min_tool_s, ("tool time is not generation time", sample.non_generation_time,
                                                     sample.metadata.get("duration_s"), sample.metadata["uid"])


def filter_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> Any:
    """slime's `check_reward_nonzero_std` as its source states it: keep a group whose rewards' standard
    deviation exceeds 1e-6, else drop it with reason `zero_std_<round(first reward, 1)>`; the result has
    `DynamicFilterOutput`'s fields."""
    from types import SimpleNamespace

    rewards = [s.get_reward_value(args) for s in samples]
    keep = bool(np.std(np.asarray(rewards, dtype=np.float64), ddof=1) > 1e-6)
    return SimpleNamespace(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}",
                           keep_when_insufficient=False)
