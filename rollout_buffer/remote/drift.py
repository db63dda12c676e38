"""Drift: where the chat template's rendering of the history differs from the tokens the trainer holds.

Before a later call the trainer holds the previous prompt (the rendering of the messages it was sent) and the
model's own `token_ids` for the reply. The new call's rendering re-renders that reply from its parsed message,
and its ids need not be the model's: tool-call JSON is re-spelled (key order, spaces), whitespace at the
turn's edges is stripped, BPE merges differ after decode -> encode, and some templates drop the reasoning of
earlier turns. The protocol's count (`remote.mask`) is lengths only, so it does not see any of this; such a
call is still counted by the formula, and what differs is measured here so that the trainer and the
operators can see it: the tokens the trainer appends as context after such a call are the rendering's last
`n`, which are `offset` tokens off from where the re-rendered reply really ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from typing import Any

# Longest stretch (tokens) compared token by token; beyond it `tokens` is bounded by the longer side.
DIFF_LIMIT = 4096
TEXT_LIMIT = 300
_CHUNK = 1024


@dataclass(frozen=True)
class Drift:
    """One call whose rendering does not start with what the trainer holds."""

    call_index: int
    region: str  # "assistant": the previous reply re-renders differently; "context": earlier prompt tokens changed
    at: int  # first differing position in the held tokens (previous prompt + previous token_ids)
    tokens: int  # size of the symmetric difference of the held and the re-rendered stretch (see DIFF_LIMIT)
    offset: int  # the formula's count minus the count of the tokens after the re-rendered stretch
    same_text: bool  # both stretches decode to the same text: only the tokenization differs
    held_text: str  # the held stretch from `at`, decoded (truncated)
    rendered_text: str  # the re-rendered stretch from `at`, decoded (truncated)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, compared a slice at a time (C speed) before the last slice token by token."""
    limit = min(len(a), len(b))
    start = 0
    while start < limit and a[start:start + _CHUNK] == b[start:start + _CHUNK]:
        start += _CHUNK
    end = min(start + _CHUNK, limit)
    while start < end and a[start] == b[start]:
        start += 1
    return min(start, limit)


def _stretch_end(render: list[int], turns: int, closed: bool, eot: int) -> int:
    """Where the render's counterpart of the held tokens ends: after its `turns`-th end-of-turn token when the
    model closed its reply, else before the next one (a reply cut short is closed by the template)."""
    position = -1
    for _ in range(turns if closed else turns + 1):
        try:
            position = render.index(eot, position + 1)
        except ValueError:
            return len(render)
    return position + 1 if closed else position


def _difference(held: list[int], rendered: list[int]) -> int:
    if max(len(held), len(rendered)) > DIFF_LIMIT:
        return max(len(held), len(rendered))
    matched = sum(block.size for block in SequenceMatcher(None, held, rendered, autojunk=False).get_matching_blocks())
    return len(held) + len(rendered) - 2 * matched


def measure_drift(call_index: int, prompt: list[int], output: list[int], render: list[int], eot: int,
                  decode: Callable[[list[int]], str]) -> Drift | None:
    """Compare the held tokens (`prompt` + `output`) with the new `render`; None when the render starts with
    them exactly."""
    held = prompt + output
    if render[:len(held)] == held:
        return None
    at = common_prefix(held, render)
    closed = bool(output) and output[-1] == eot
    end = max(_stretch_end(render, held.count(eot), closed, eot), at)
    held_part, rendered_part = held[at:], render[at:end]
    held_text, rendered_text = decode(held_part), decode(rendered_part)
    return Drift(call_index=call_index, region="context" if at < len(prompt) else "assistant", at=at,
                 tokens=_difference(held_part, rendered_part), offset=end - len(held),
                 same_text=held_text == rendered_text, held_text=held_text[:TEXT_LIMIT],
                 rendered_text=rendered_text[:TEXT_LIMIT])


@dataclass
class DriftTally:
    """A rollout's drift so far: calls counted, calls with drift, differing tokens, the first example."""

    counted_calls: int = 0
    drift_calls: int = 0
    drift_tokens: int = 0
    first: Drift | None = None

    def add(self, drift: Drift | None) -> None:
        self.counted_calls += 1
        if drift is None:
            return
        self.drift_calls += 1
        self.drift_tokens += drift.tokens
        if self.first is None:
            self.first = drift

    def as_dict(self) -> dict[str, Any]:
        return {"counted_calls": self.counted_calls, "drift_calls": self.drift_calls,
                "drift_tokens": self.drift_tokens, "first_drift": self.first.as_dict() if self.first else None}
