"""The training `Sample`: slime's own class when slime is installed, a field-compatible stand-in otherwise.

The stand-in lets the adapter (and its tests) run without slime and torch; the builders only use field
names that slime's class has too, and `make_sample` drops fields an older slime does not know.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Sample", "SLIME_AVAILABLE", "make_sample", "status_from_record", "sample_field_names"]


@dataclass
class _FallbackSample:
    """Field-for-field stand-in for `slime.utils.types.Sample` (plain dataclass, no torch)."""

    group_index: int | None = None
    index: int | str | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Same shape as slime's `to_dict`: the status as its text value."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "_FallbackSample":
        data = dict(data)
        data["status"] = cls.Status(data["status"])
        return cls(**data)

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: the whole reward, or one key of a dict reward."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]  # type: ignore[index]


try:  # pragma: no cover - depends on the environment
    from slime.utils.types import Sample as _SlimeSample  # type: ignore[import-not-found]

    Sample: Any = _SlimeSample
    SLIME_AVAILABLE = True
except ImportError:
    Sample = _FallbackSample
    SLIME_AVAILABLE = False


def sample_field_names() -> frozenset[str]:
    """The fields the active `Sample` class accepts (slime versions differ)."""
    return frozenset(f.name for f in dataclasses.fields(Sample))


def make_sample(**values: Any) -> Any:
    """Build a `Sample`, silently leaving out fields this slime version does not have.

    Only optional extras (`group_index`, `weight_versions`) may be dropped; the core fields exist in
    every slime version, so a missing core field is a programming error and raises.
    """
    names = sample_field_names()
    optional = {"group_index", "weight_versions", "remove_sample"}
    unknown = set(values) - names
    if unknown - optional:
        raise TypeError(f"Sample has no field(s) {sorted(unknown - optional)}")
    return Sample(**{k: v for k, v in values.items() if k in names})


_STATUS_NAMES: dict[str, str] = {
    "completed": "COMPLETED",
    "truncated": "TRUNCATED",
    "aborted": "ABORTED",
    "failed": "FAILED",
}


def status_from_record(status: str) -> Any:
    """Map a record's `status` text to `Sample.Status`.

    An older slime without `FAILED` gets `ABORTED` (both mean "no usable ending"); the builders keep the
    record's own text in `metadata["record_status"]` so nothing is lost.
    """
    try:
        name = _STATUS_NAMES[status]
    except KeyError:
        raise ValueError(f"unknown record status {status!r}; expected one of {sorted(_STATUS_NAMES)}") from None
    member = getattr(Sample.Status, name, None)
    if member is None:
        member = Sample.Status.ABORTED
    return member
