"""Python verifiers the agent_command tests name by module path."""

from typing import Any


async def length_reward(sandbox: Any, sample: dict, result: Any) -> float:
    return len(sample["label"]) / len(result.final_text)


def broken(sandbox: Any, sample: dict, result: Any) -> float:
    return 1 / 0


def always_one(sandbox: Any, sample: dict, result: Any) -> dict:
    return {"reward": 1.0, "checked_by": "always_one"}


async def exact_unless_verr(sandbox: Any, sample: dict, result: Any) -> dict:
    """Exact answer, except that the verifier breaks on the first rollout of an instance named `verr-*`."""
    import os

    from rollout_buffer.agents.verifiers import exact_answer

    if sample["instance_id"].startswith("verr"):
        try:
            os.mkdir(os.path.join(sample["marks"], "verr"))
        except FileExistsError:
            pass
        else:
            raise RuntimeError("grader crashed (injected)")
    return await exact_answer(sandbox, sample, result)
