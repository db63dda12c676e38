"""A run's plan: every (epoch, instance, repeat) it rolls out, in the fixed order the job stream is
filled in (`runtime.jobqueue`), and its size, which admission and the run's cap (`--max-tasks-per-run`)
count."""

from __future__ import annotations

from collections.abc import Iterator


def iter_job_plan(instance_ids: list[str], num_epoch: int, repeats: int) -> Iterator[tuple[int, int, str, int]]:
    """(seq, epoch, instance_id, repeat) for the whole run, in a fixed order; seq counts from 1."""
    seq = 0
    for epoch in range(num_epoch):
        for instance_id in instance_ids:
            for repeat in range(repeats):
                seq += 1
                yield seq, epoch, instance_id, repeat


def planned_jobs(instance_ids: list[str], num_epoch: int, repeats: int, excluded: set[str]) -> int:
    """How many jobs `iter_job_plan` yields outside the `excluded` groups, without walking the plan."""
    ids = set(instance_ids)
    skipped = 0
    for group_id in excluded:
        epoch, _, instance_id = group_id.partition(":")
        if epoch.isdecimal() and int(epoch) < num_epoch and instance_id in ids:
            skipped += 1
    return (len(ids) * num_epoch - skipped) * repeats
