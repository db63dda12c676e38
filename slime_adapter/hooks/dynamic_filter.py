"""slime's dynamic sampling filter (`--dynamic-sampling-filter-path`), run on the groups this adapter reads.

The function is slime's own, loaded by its dotted path and called as slime calls it: `fn(args, samples)`
with one group's `Sample`s, returning slime's `DynamicFilterOutput(keep, reason, keep_when_insufficient)`
or, from older filters, a plain bool. A rejected group is dropped unless it carries
`keep_when_insufficient` and the candidates left (groups in hand plus groups read but not judged yet) no
longer exceed what the step needs, slime's `should_drop_dynamic_filter_output` rule. Drops are counted by
reason as slime's `MetricGatherer` counts them (`rollout/dynamic_filter/drop_<reason>`; a drop without a
reason is not in slime's metric, so it is counted in `rollout/dynamic_filter/dropped_groups`, which holds
every adapter-side drop). The buffer-side group filter (`agent_group_filter`) filters before hand-over
and reports its drops under the same names.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DropCounts", "Verdict", "judge", "load_filter", "should_drop"]


@dataclass(frozen=True)
class Verdict:
    """slime's `DynamicFilterOutput`, read from whatever the filter returned."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def load_filter(path: str | None) -> Callable[..., Any] | None:
    """The function at `module.attr` (slime's `load_function`), None without a path."""
    if not path:
        return None
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"dynamic_sampling_filter_path must be 'module.function', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def judge(fn: Callable[..., Any] | None, args: Any, samples: list[Any]) -> Verdict:
    """Call the filter on one group (slime's `call_dynamic_filter`); no filter keeps everything."""
    if fn is None:
        return Verdict(keep=True)
    output = fn(args, samples)
    if hasattr(output, "keep"):
        reason = getattr(output, "reason", None)
        return Verdict(keep=bool(output.keep), reason=None if reason is None else str(reason),
                       keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)))
    return Verdict(keep=bool(output))


def should_drop(verdict: Verdict, *, candidates: int, target: int) -> bool:
    """slime's rule: a rejected group is kept when it may keep itself and dropping it leaves too few."""
    if verdict.keep:
        return False
    return not (verdict.keep_when_insufficient and candidates <= target)


@dataclass
class DropCounts:
    """Dropped groups of one step, by reason."""

    by_reason: Counter[str] = field(default_factory=Counter)
    total: int = 0

    def note(self, reason: str | None) -> None:
        self.total += 1
        if reason:
            self.by_reason[reason] += 1

    def metrics(self) -> dict[str, int]:
        out = {f"rollout/dynamic_filter/drop_{reason}": count for reason, count in self.by_reason.items()}
        out["rollout/dynamic_filter/dropped_groups"] = self.total
        return out
