"""Character spans -> token mask, with one rule for tokens that straddle a span edge.

The rule (principle 2: one documented rule, never a silent guess): a token trains (mask 1) only if every
character it covers is generated text, i.e. it lies inside one assistant span: `span.start <= start`,
`end <= span.end` (and `start < span.end`, which only matters for an empty offset). A token that covers
characters of a span and characters outside it (template text such as the `\\n` of `assistant\\n` merged
with a generated leading `\\n` into one `\\n\\n` BPE token) is an *edge token*: mask 0, and counted. All
other tokens are 0.

Re-tokenizing cannot say which of the generated characters the policy's own ids covered inside such a
token, so no exact 1 exists for it; 0 trains nothing the policy did not generate, at the price of not
training those few generated characters, and the count makes that price visible.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from operator import le

from slime_adapter.masks.span_locators import CharSpan, LossMaskError

__all__ = ["SpanTokens", "mask_from_offsets", "token_ranges", "is_sorted"]


@dataclass(frozen=True)
class SpanTokens:
    """Token view of the spans of one rendering.

    `inner[k]` = `[first, stop)`: the tokens wholly inside span k (mask 1 when span k trains);
    `first` is also where span k's tokens begin (every token from there starts inside or after the span).
    `touch[k]` = `[lo, hi)`: every token that covers a character of span k, edge tokens included.
    `edges[k]`: the edge tokens of span k (a token straddling the end of one span and the start of the next
    is listed under both).
    """

    inner: list[tuple[int, int]]
    touch: list[tuple[int, int]]
    edges: list[list[int]]

    def mask(self, n_tokens: int, trained: Sequence[bool] | None = None) -> list[int]:
        """The loss mask over all `n_tokens`: 1 on the inner tokens of every trained span."""
        mask = [0] * n_tokens
        for k, (first, stop) in enumerate(self.inner):
            if trained is None or trained[k]:
                mask[first:stop] = [1] * (stop - first)
        return mask

    def edge_count(self, trained: Sequence[bool] | None = None) -> int:
        """Distinct edge tokens of the trained spans (each counted once)."""
        seen: set[int] = set()
        for k, edges in enumerate(self.edges):
            if trained is None or trained[k]:
                seen.update(edges)
        return len(seen)


def is_sorted(values: list[int]) -> bool:
    return all(map(le, values, islice(values, 1, None)))


def token_ranges(starts: list[int], ends: list[int], spans: Sequence[CharSpan]) -> SpanTokens:
    """The span rule by bisection over monotone offsets (O(spans * log n) instead of a Python loop over
    every token); `starts` and `ends` must each be non-decreasing."""
    inner: list[tuple[int, int]] = []
    touch: list[tuple[int, int]] = []
    edges: list[list[int]] = []
    for span in spans:
        a, b = span.start, span.end
        first = bisect_left(starts, a)  # tokens from here start at or after the span start
        lo = bisect_right(ends, a, 0, first)  # [lo, first): start before the span, end inside or past it
        stop = bisect_left(starts, b, first)  # [first, stop): start inside the span
        inner_stop = bisect_right(ends, b, first, stop)  # [first, inner_stop): also end inside it
        inner.append((first, inner_stop))
        touch.append((lo, stop))
        edges.append([*range(lo, first), *range(inner_stop, stop)])
    return SpanTokens(inner=inner, touch=touch, edges=edges)


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]) -> SpanTokens:
    """The same rule token by token, span by span: the general fallback for offsets that are not monotone
    (and the plain statement of the rule that `token_ranges` computes by bisection)."""
    n = len(offsets)
    inner: list[tuple[int, int]] = []
    touch: list[tuple[int, int]] = []
    edges: list[list[int]] = []
    for k, span in enumerate(spans):
        a, b = span.start, span.end
        inside = [t for t, (s, e) in enumerate(offsets) if a <= s and e <= b and s < b]
        straddling = [t for t, (s, e) in enumerate(offsets) if s < b and e > a and not (a <= s and e <= b)]
        if inside and inside[-1] - inside[0] + 1 != len(inside):
            raise LossMaskError(f"the tokens inside assistant span {k} are not contiguous: inconsistent offsets")
        first = inside[0] if inside else next((t for t, (s, _) in enumerate(offsets) if s >= a), n)
        inner.append((first, inside[-1] + 1 if inside else first))
        covered = inside + straddling
        touch.append((min(covered), max(covered) + 1) if covered else (first, first))
        edges.append(straddling)
    return SpanTokens(inner=inner, touch=touch, edges=edges)
