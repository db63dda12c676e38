"""Python verifiers the agent_command tests name by module path."""

from typing import Any


async def length_reward(sandbox: Any, sample: dict, result: Any) -> float:
    return len(sample["label"]) / len(result.final_text)


def broken(sandbox: Any, sample: dict, result: Any) -> float:
    return 1 / 0


def always_one(sandbox: Any, sample: dict, result: Any) -> dict:
    return {"reward": 1.0, "checked_by": "always_one"}
