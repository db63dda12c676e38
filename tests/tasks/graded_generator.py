"""A task with slime-style group hooks: groups whose rewards are all 0 are filtered out, the rest are
GRPO-normalised, and the meta info hook adds a field."""

from rollout_buffer.groups import grpo_normalize_group

TASK_TYPE = "graded"


def run_rollout(data: dict) -> None:
    return None


def is_valid_group(group, min_valid_group_size, task_type):
    instance_id, items = group
    return len(items) >= min_valid_group_size and any(item["reward"] != 0 for item in items)


def transform_group(group, task_type):
    return grpo_normalize_group(group, task_type)


def get_group_data_meta_info(temp_data):
    return {"hook_groups": sorted(temp_data)}
