"""Policy versions and staleness: what a turn, a record and a read are stamped with, and how stale a read is.

A version is an int: the trainer's policy version (slime's `rollout_id`). An engine's `weight_version` counts
when it is one (an int, or a string of digits, as SGLang reports `"3"`); anything else (SGLang's default
`"default"`) is no version, and the buffer's policy version when the call started stands in for it. A
record's version is its oldest turn's; a sample's staleness at hand-over is the read's policy version minus
the record's version.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

_DIGITS = re.compile(r"^\s*\d+\s*$")


def as_version(value: Any) -> int | None:
    """`value` as a policy version, or None when it is not one (None, bools, non-digit strings, negatives)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and _DIGITS.match(value):
        return int(value)
    return None


def merge_spans(pieces: Iterable[tuple[int | None, int]]) -> list[list[int | None]]:
    """Run-length form `[[version, tokens], ...]` of consecutive output pieces, equal neighbours merged."""
    spans: list[list[int | None]] = []
    for version, count in pieces:
        if spans and spans[-1][0] == version:
            spans[-1][1] = int(spans[-1][1] or 0) + count
        else:
            spans.append([version, count])
    return spans


def _field(turn: Any, name: str) -> Any:
    return turn.get(name) if isinstance(turn, dict) else getattr(turn, name, None)


def turn_versions(turn: Any) -> list[int]:
    """Every version a turn's tokens were generated under: its `weight_version` and its `version_spans`.
    Works on turn dicts, validated turn objects and the packed form's turn metadata (`vs`)."""
    found = [as_version(_field(turn, "weight_version"))]
    spans = _field(turn, "version_spans") or (turn.get("vs") if isinstance(turn, dict) else None) or []
    found.extend(as_version(span[0]) for span in spans if isinstance(span, (list, tuple)) and span)
    return [v for v in found if v is not None]


def oldest(versions: Iterable[int | None]) -> int | None:
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def record_version(record: dict[str, Any]) -> int | None:
    """A record's policy version: its own `policy_version` when given, else its oldest turn's, else its
    top-level `weight_version` when that is a version."""
    explicit = as_version(record.get("policy_version"))
    if explicit is not None:
        return explicit
    turns = record.get("turns")
    if turns is None:
        turns = record.get("_turns")  # a packed record's header
    from_turns = oldest(v for turn in turns or [] for v in turn_versions(turn))
    if from_turns is not None:
        return from_turns
    return as_version(record.get("weight_version"))


def staleness_summary(read_version: int | None, versions: Sequence[int | None],
                      bound: int | None) -> tuple[dict[str, Any], Counter[int]]:
    """`meta_info.staleness` of one read (`{min, mean, max, over_bound}`, nulls when no sample is versioned)
    and its histogram (staleness -> samples)."""
    values = [read_version - v for v in versions if v is not None] if read_version is not None else []
    if not values:
        return {"min": None, "mean": None, "max": None, "over_bound": 0}, Counter()
    over = sum(1 for s in values if bound is not None and s > bound)
    summary = {"min": min(values), "mean": sum(values) / len(values), "max": max(values), "over_bound": over}
    return summary, Counter(values)
