"""A task whose records come from outside (tests write them with POST /buffer/write)."""

TASK_TYPE = "external"


def run_rollout(data: dict) -> None:
    return None
