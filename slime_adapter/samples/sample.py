"""The training `Sample`: slime's own class when slime is installed, a field-compatible stand-in otherwise.

The stand-in lets the adapter (and its tests) run without slime and torch; the builders only use field
names that slime's class has too, and `make_sample` drops fields an older slime does not know.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

_SLIME_TYPES = "slime.utils.types"
__all__ = ["OPTIONAL_FIELDS", "SLIME_AVAILABLE", "Sample", "make_sample", "sample_class", "sample_field_names",
           "status_from_record"]

# Fields newer than the oldest slime the adapter supports: left out where the Sample class lacks them.
OPTIONAL_FIELDS: frozenset[str] = frozenset({
    "group_index", "weight_versions", "remove_sample", "rollout_id", "session_id", "non_generation_time",
    "train_metadata", "spec_info", "prefix_cache_info", "rollout_routed_experts", "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
})


@dataclass
class _FallbackSample:
    """Field-for-field stand-in for `slime.utils.types.Sample` (plain dataclass, no torch)."""

    group_index: int | None = None
    index: int | str | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """slime's speculative decoding counts, summed over engine calls."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        def to_dict(self) -> dict[str, int]:
            return dict(self.__dict__)

    @dataclass
    class PrefixCacheInfo:
        """slime's prefix cache counts, summed over engine calls."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        def to_dict(self) -> dict[str, int]:
            return dict(self.__dict__)

    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict[str, Any]:
        """Same shape as slime's `to_dict`: the status as its text value, the info classes as dicts."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "_FallbackSample":
        data = dict(data)
        data["status"] = cls.Status(data["status"])
        data["spec_info"] = cls.SpecInfo(**data.get("spec_info", {}))
        data["prefix_cache_info"] = cls.PrefixCacheInfo(**data.get("prefix_cache_info", {}))
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


def sample_class() -> Any:
    """slime's `Sample` when slime is imported (also when that happened after this module was: a trainer
    that imports slime late, a test that puts a checkout on the path), else the stand-in."""
    module = sys.modules.get(_SLIME_TYPES)
    return getattr(module, "Sample", Sample) if module is not None else Sample


def sample_field_names() -> frozenset[str]:
    """The fields the active `Sample` class accepts (slime versions differ)."""
    return _field_names(sample_class())


@functools.lru_cache(maxsize=8)
def _field_names(cls: type) -> frozenset[str]:  # per class: read for every sample built
    return frozenset(f.name for f in dataclasses.fields(cls))


def make_sample(**values: Any) -> Any:
    """Build a `Sample`, silently leaving out fields this slime version does not have.

    Only optional extras (`OPTIONAL_FIELDS`) may be dropped; the core fields exist in every slime version,
    so a missing core field is a programming error and raises. `spec_info` and `prefix_cache_info` are
    given as slime's `to_dict()` forms and become the class's own info objects.
    """
    names = sample_field_names()
    unknown = set(values) - names
    if unknown - OPTIONAL_FIELDS:
        raise TypeError(f"Sample has no field(s) {sorted(unknown - OPTIONAL_FIELDS)}")
    kept = {k: v for k, v in values.items() if k in names}
    cls = sample_class()
    for name, cls_name in (("spec_info", "SpecInfo"), ("prefix_cache_info", "PrefixCacheInfo")):
        if isinstance(kept.get(name), dict):
            info = getattr(cls, cls_name)()
            for key, value in kept[name].items():
                setattr(info, key, value)
            kept[name] = info
    return cls(**kept)


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
    status = sample_class().Status
    member = getattr(status, name, None)
    if member is None:
        member = status.ABORTED
    return member
