"""Group filters (DAPO's dynamic sampling): which complete groups are worth training on.

`/start_rollout` names one in `group_filter`:

* `"nonzero_std"`: drop a group whose rewards are all equal (every sample right, or every one wrong): its
  group-relative advantages are all zero, so it teaches nothing. Reason `zero_std`. Needs groups of 2+.
* a dotted path `package.module.function` to a function with slime's `is_valid_group` signature,
  `(group: tuple[instance_id, list[record]], min_valid_group_size: int, task_type: str)`, returning a
  bool or an object with `keep` and `reason` (slime's `DynamicFilterOutput`). A dropped group's reason is
  the `reason` it gives, else the function's name.

Rewards are read before the task's own hooks run: `raw_reward` when a record has one, else `reward`.
The filter runs where groups are handed over (`rollout_buffer.runs.reads`); what it drops is counted by reason
(`drop:<reason>`), reported in `meta_info`, and replaced from the prompt stream (`rollout_buffer.store.stream_lua`)
so a reader still gets full batches.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NONZERO_STD = "nonzero_std"
ZERO_STD_REASON = "zero_std"
STD_EPSILON = 1e-6
_REASON_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class GroupFilterError(ValueError):
    """A `group_filter` that names nothing usable."""


def _reward(record: dict[str, Any]) -> float:
    raw = record.get("raw_reward")
    return float(raw if raw is not None else record.get("reward", 0.0))


def zero_std(records: list[dict[str, Any]]) -> bool:
    """Whether the group's rewards are all equal (within `STD_EPSILON`)."""
    rewards = [_reward(r) for r in records]
    return not rewards or max(rewards) - min(rewards) <= STD_EPSILON


def reason_name(reason: Any) -> str:
    """A counter-safe reason: letters, digits, `_ . -` (others become `_`), at most 64 characters."""
    return _REASON_CHARS.sub("_", str(reason))[:64] or "filtered"


@dataclass(frozen=True)
class GroupFilter:
    """A loaded filter; `judge` gives the reason a group is dropped, or None to keep it."""

    spec: str
    function: Callable[..., Any] | None = None  # None: the built-in nonzero_std

    def judge(self, instance_id: str, records: list[dict[str, Any]], min_valid_group_size: int,
              task_type: str) -> str | None:
        if self.function is None:
            return ZERO_STD_REASON if zero_std(records) else None
        verdict = self.function((instance_id, records), min_valid_group_size, task_type)
        keep = getattr(verdict, "keep", verdict)
        if keep:
            return None
        return reason_name(getattr(verdict, "reason", None) or getattr(self.function, "__name__", "group_filter"))


@functools.lru_cache(maxsize=64)
def load(spec: str) -> GroupFilter:
    """The filter `spec` names; raises GroupFilterError saying why it cannot be used."""
    spec = spec.strip()
    if spec == NONZERO_STD:
        return GroupFilter(spec)
    if not _DOTTED.match(spec):
        raise GroupFilterError(f"must be {NONZERO_STD!r} or a dotted path 'package.module.function' (got {spec!r})")
    module_name, _, name = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to see
        raise GroupFilterError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise GroupFilterError(f"module {module_name!r} has no function {name!r}")
    if not takes_group_arguments(function):
        raise GroupFilterError(f"{spec!r} is not a group filter: it must take (group, min_valid_group_size, "
                               "task_type), slime's is_valid_group signature")
    return GroupFilter(spec, function)


def takes_group_arguments(function: Callable[..., Any]) -> bool:
    """Whether `function` takes exactly the three positional arguments a filter is called with (named
    parameters, not `*args`; any further ones have defaults). Refuses `os.system` and the like."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keywords = [p for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    return len(positional) >= 3 and not required_keywords and all(p.default is not p.empty for p in positional[3:])
