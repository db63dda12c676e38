"""What a token-path piece carries besides tokens, mask and logprobs: slime's per-call `meta_info` fields.

slime fills its `Sample` from every `/generate` answer (`Sample._apply_meta_info`): one
`weight_versions` entry per engine call (the engine's own string), `prefix_cache_info` and `spec_info`
summed over the calls, and the replay arrays: `rollout_top_p_token_ids/offsets` (one span per response
token; tokens the policy did not generate get empty spans) and `rollout_routed_experts` (one row per token
but the last; a call's rows from its `routed_experts_start_len` replace what was held from that row on).
A record's turns keep the same per call (`Turn.calls`) and per turn (the arrays, joined over the turn's
calls by the runtime); this module joins them over the turns of one piece the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PieceReplay", "piece_replay"]


def _as_int(value: Any) -> int | None:
    """A policy version stamp as an int (the engine's own labels such as "default" are none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.isdecimal() else None


def _field(turn: Any, name: str) -> Any:
    return turn.get(name) if isinstance(turn, dict) else getattr(turn, name, None)


@dataclass
class PieceReplay:
    """The joined per-call fields of one piece (turns `first..last` of a record)."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    #: (rows, values per row) int32, one row per token of the piece but the last; None without replay
    routed_experts: np.ndarray | None = None
    #: why the turns' routed experts could not be joined (the sample then carries none)
    experts_problem: str | None = None
    top_p_token_ids: list[int] | None = None
    top_p_token_offsets: list[int] | None = None
    #: the buffer's policy versions the piece's tokens were generated under (sorted, distinct)
    policy_versions: list[int] = field(default_factory=list)

    def weight_versions(self) -> list[str]:
        """slime's `Sample.weight_versions`: the engine's `weight_version` of every call that reported one."""
        return [str(c["weight_version"]) for c in self.calls if c.get("weight_version") is not None]

    def prefix_cache(self) -> dict[str, int]:
        """slime's `PrefixCacheInfo.to_dict()` over the calls."""
        return {"cached_tokens": sum(int(c.get("cached_tokens") or 0) for c in self.calls),
                "total_prompt_tokens": sum(int(c.get("prompt_tokens") or 0) for c in self.calls)}

    def spec(self) -> dict[str, int] | None:
        """slime's `SpecInfo.to_dict()` over the calls; None when no call reported speculative counts."""
        if not any(key.startswith("spec_") for c in self.calls for key in c):
            return None
        total = {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                 "completion_token_num": 0}
        for call in self.calls:
            for key in ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct"):
                total[key] += int(call.get(key) or 0)
            total["completion_token_num"] += int(call.get("completion_tokens") or 0)
        return total


def _join_experts(experts: np.ndarray | None, values: Any, start: int,
                  rows: int) -> tuple[np.ndarray | None, str | None]:
    """One turn's routed experts joined onto the piece's so far (slime's rule)."""
    array = np.asarray(values, dtype=np.int32).reshape(-1)
    if rows <= 0 or array.size % rows:
        return None, f"{array.size} routed expert ids are not a whole number of rows for {rows} token(s)"
    array = array.reshape(rows, -1)
    if start == 0:
        return array, None
    if experts is None or len(experts) < start or experts.shape[1] != array.shape[1]:
        return None, f"routed experts start at row {start} but the tokens before it have none"
    return np.concatenate([experts[:start], array]), None


def piece_replay(turns: Sequence[Any], first: int, last: int) -> PieceReplay:
    """Join the calls and replay arrays of turns `first..last` (one piece: each prompt extends the last)."""
    replay = PieceReplay()
    history = len(_field(turns[first], "prompt_ids"))
    offsets: list[int] = [0]
    top_p_ids: list[np.ndarray] = []
    has_top_p = has_experts = False
    experts: np.ndarray | None = None
    versions: set[int] = set()
    for j in range(first, last + 1):
        turn = turns[j]
        prompt_len, outputs = len(_field(turn, "prompt_ids")), len(_field(turn, "output_ids"))
        replay.calls.extend(dict(c) for c in _field(turn, "calls") or [])
        offsets.extend([offsets[-1]] * (prompt_len - history if j > first else 0))  # context: empty spans
        ids, turn_offsets = _field(turn, "top_p_token_ids"), _field(turn, "top_p_token_offsets")
        if ids is not None and turn_offsets is not None:
            has_top_p = True
            top_p_ids.append(np.asarray(ids, dtype=np.int32).reshape(-1))
            offsets.extend((np.asarray(turn_offsets[1:], dtype=np.int64) + offsets[-1]).tolist())
        else:
            offsets.extend([offsets[-1]] * outputs)
        values = _field(turn, "routed_experts")
        if values is not None and replay.experts_problem is None:
            has_experts = True
            start = int(_field(turn, "routed_experts_start_len") or 0)
            experts, replay.experts_problem = _join_experts(experts, values, start, prompt_len + outputs - 1 - start)
        history = prompt_len + outputs
        spans = _field(turn, "version_spans") or [(_field(turn, "weight_version"), outputs)]
        versions.update(v for v in (_as_int(v) for v, count in spans if int(count) > 0) if v is not None)
    replay.policy_versions = sorted(versions)
    if has_top_p:
        replay.top_p_token_ids = np.concatenate(top_p_ids).tolist()
        replay.top_p_token_offsets = offsets
    if has_experts and replay.experts_problem is None:
        if experts is None or len(experts) != history - 1:
            replay.experts_problem = (f"routed experts cover {0 if experts is None else len(experts)} token(s), "
                                      f"the sample has {history} (a later turn came without them)")
        else:
            replay.routed_experts = experts
    return replay
