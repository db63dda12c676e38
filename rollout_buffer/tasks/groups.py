"""Group hooks with slime's signatures: their defaults and the built-in GRPO reward normalisation.

A group is `(instance_id, items)`: the records of one instance id in one epoch of one run. A task module
may override any hook (see `rollout_buffer.tasks.contract`); these are used where it does not.
"""

from __future__ import annotations

import math
from typing import Any

Group = tuple[str, list[dict[str, Any]]]


def default_is_valid_group(group: Group, min_valid_group_size: int, task_type: str) -> bool:
    """Valid when it has at least `min_valid_group_size` members and one of them did not fail."""
    _, items = group
    return len(items) >= min_valid_group_size and any(item.get("status") != "failed" for item in items)


def default_transform_group(group: Group, task_type: str) -> Group:
    return group


def grpo_normalize_group(group: Group, task_type: str = "", epsilon: float = 1e-6) -> Group:
    """GRPO advantage: (reward - group mean) / (group std + eps); a zero-variance group gets 0.

    The reward before normalisation is kept as `raw_reward` (unless the record already had one).
    Failed members take part with their recorded reward, so the group's statistics are honest.
    """
    instance_id, items = group
    if not items:
        return group
    rewards = [float(item["reward"]) for item in items]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    out: list[dict[str, Any]] = []
    for item, reward in zip(items, rewards):
        normalized = 0.0 if std < epsilon else (reward - mean) / (std + epsilon)
        raw = item.get("raw_reward")
        out.append({**item, "raw_reward": reward if raw is None else raw, "reward": normalized})
    return instance_id, out

