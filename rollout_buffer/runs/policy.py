"""A run's staleness bound and group filter, read from the `/start_rollout` body and kept in its meta.

Fields (all optional; values may be strings, as slime sends them):

* `max_staleness`: how many policy versions older than the reader's a handed-over sample may be (default:
  unbounded). Enforced at hand-over (`rollout_buffer.store.handover_lua.READ_READY`) and at admission: workers do not
  start a group while started-and-unconsumed groups number `(max_staleness + 1) x` the groups per read
  (`rollout_buffer.runtime.jobqueue`).
* `stale_policy`: what happens to a group staler than the bound when a reader meets it: `requeue`
  (default: roll it out again, native tasks only), `drop`, or `keep` (hand it over and count it).
* `max_requeues`: how often one group may be rolled out again (default 3); a group still too stale after
  that is dropped (`drop:stale_requeue_limit`), so a prompt that is always slow cannot loop for ever.
* `group_filter`: `nonzero_std` or a dotted path (see `rollout_buffer.runs.group_filter`).
* `max_extra_groups`: groups the prompt stream may add past the plan to replace filtered ones (default:
  as many as the plan has: lines x num_epoch).
* `rollout_batch_size`: the trainer's groups per read, for admission before its first read (default:
  `num_process / num_repeat_per_sample`); later reads set it. Not part of the run's identity.
* `policy_version`: the trainer's policy version at start (its rollout id). Not part of the run's identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollout_buffer.runs import group_filter
from rollout_buffer.wire.schema import StartRolloutRequest

STALE_POLICIES = ("requeue", "drop", "keep")


class PolicyError(ValueError):
    """A staleness or filter field that cannot be used; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def _int(extra: dict[str, Any], name: str, minimum: int) -> int | None:
    value = extra.get(name)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise PolicyError(name, f"not a number: {value!r}") from exc
    if not number.is_integer() or isinstance(value, bool):
        raise PolicyError(name, f"must be a whole number (got {value!r})")
    if number < minimum:
        raise PolicyError(name, f"must be >= {minimum} (got {value!r})")
    return int(number)


@dataclass(frozen=True)
class RunPolicy:
    max_staleness: int | None
    stale_policy: str
    group_filter: str | None
    max_extra_groups: int | None
    max_requeues: int | None
    groups_per_read_hint: int
    policy_version: int | None

    @classmethod
    def from_request(cls, request: StartRolloutRequest, task_kind: str) -> RunPolicy:
        """Raises PolicyError naming the field of an unusable value."""
        extra = dict(request.model_extra or {})
        bound = _int(extra, "max_staleness", 0)
        policy = str(extra.get("stale_policy") or "requeue").strip().lower()
        if policy not in STALE_POLICIES:
            raise PolicyError("stale_policy", f"must be one of {', '.join(STALE_POLICIES)} (got {policy!r})")
        if bound is not None and policy == "requeue" and task_kind != "native":
            raise PolicyError("stale_policy", "'requeue' (the default) rolls a stale group out again, which only "
                                              "a native task's runtime can do; a slime-style module writes its own "
                                              "records: set stale_policy to 'drop' or 'keep'")
        spec = extra.get("group_filter")
        spec = str(spec).strip() if spec not in (None, "") else None
        if spec is not None:
            try:
                group_filter.load(spec)
            except group_filter.GroupFilterError as exc:
                raise PolicyError("group_filter", str(exc)) from exc
            if spec == group_filter.NONZERO_STD and request.num_repeat_per_sample < 2:
                raise PolicyError("group_filter", "'nonzero_std' needs groups of 2 or more "
                                                  "(num_repeat_per_sample >= 2): one reward has no spread")
        batch = _int(extra, "rollout_batch_size", 1)
        hint = batch if batch is not None else max(1, math.ceil(request.num_process / request.num_repeat_per_sample))
        return cls(max_staleness=bound, stale_policy=policy, group_filter=spec,
                   max_extra_groups=_int(extra, "max_extra_groups", 0), max_requeues=_int(extra, "max_requeues", 0),
                   groups_per_read_hint=hint,
                   policy_version=_int(extra, "policy_version", 0))

    def meta(self) -> dict[str, Any]:
        """The fields the run's meta keeps for the Lua scripts (absent ones mean: no bound, no filter)."""
        fields: dict[str, Any] = {"stale_policy": self.stale_policy, "groups_per_read_hint": self.groups_per_read_hint,
                                  "plan_seq": 0}
        if self.max_staleness is not None:
            fields["max_staleness"] = self.max_staleness
        if self.group_filter is not None:
            fields["group_filter"] = self.group_filter
        if self.max_requeues is not None:
            fields["max_requeues"] = self.max_requeues
        if self.max_extra_groups is not None:
            fields["extra_groups_cap"] = self.max_extra_groups
        if self.policy_version is not None:
            fields["policy_version"] = self.policy_version
            fields["consumed_before_version"] = 0
        return fields
