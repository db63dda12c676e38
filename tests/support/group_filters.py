"""Group filters with slime's `is_valid_group` signature, importable by a buffer started from the repo root
(`group_filter: "tests.support.group_filters.<name>"`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def not_all_perfect(group: tuple[str, list[dict[str, Any]]], min_valid_group_size: int, task_type: str) -> Any:
    """Drop groups where every sample scored 1.0, with a reason, as slime's `DynamicFilterOutput` gives."""
    _, records = group
    perfect = all(float(r["reward"]) >= 1.0 for r in records)
    return SimpleNamespace(keep=not perfect, reason="all_perfect" if perfect else None)


def keep_even(group: tuple[str, list[dict[str, Any]]], min_valid_group_size: int, task_type: str) -> bool:
    """A plain bool filter: keeps instances whose id ends in an even digit."""
    return int(group[0][-1]) % 2 == 0
