"""`/start_rollout`'s staleness and filter fields, parsed into the run's meta."""

from __future__ import annotations

import pytest

from rollout_buffer.runs.lifecycle import derive_run_id
from rollout_buffer.runs.policy import PolicyError, RunPolicy
from rollout_buffer.wire.schema import StartRolloutRequest


def request(**extra: object) -> StartRolloutRequest:
    return StartRolloutRequest.model_validate({"task_type": "math", "input_file": "x.jsonl", "num_process": "16",
                                               "num_repeat_per_sample": "4", **extra})


def test_fields_as_slime_sends_them() -> None:
    policy = RunPolicy.from_request(request(max_staleness="2", stale_policy="Drop", rollout_batch_size="8",
                                            policy_version="5", max_requeues="0", max_extra_groups="10"), "native")
    assert policy.meta() == {"stale_policy": "drop", "groups_per_read_hint": 8, "plan_seq": 0, "max_staleness": 2,
                             "max_requeues": 0, "extra_groups_cap": 10, "policy_version": 5,
                             "consumed_before_version": 0}


def test_defaults() -> None:
    policy = RunPolicy.from_request(request(), "legacy")
    assert (policy.max_staleness, policy.stale_policy, policy.group_filter) == (None, "requeue", None)
    assert policy.groups_per_read_hint == 4, "before any read: num_process / num_repeat_per_sample groups"
    assert policy.meta() == {"stale_policy": "requeue", "groups_per_read_hint": 4, "plan_seq": 0}


def test_a_whole_number_is_required() -> None:
    with pytest.raises(PolicyError, match="whole number"):
        RunPolicy.from_request(request(max_staleness="1.5"), "native")


def test_the_trainers_version_and_batch_size_do_not_change_the_run() -> None:
    assert derive_run_id(request(policy_version="3", rollout_batch_size="8")) == derive_run_id(request())
    assert derive_run_id(request(max_staleness="1")) != derive_run_id(request()), "a bound is another run"
