"""The adapter's side of staleness and group filters: what it sends, and the step's `rollout/` metrics
from its reads' `meta_info`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime_adapter.hooks.evaluation import EvalDataset, start_payload
from slime_adapter.hooks.metrics import rollout_metrics
from slime_adapter.reading.buffer_client import staleness_fields
from slime_adapter.settings import AgentRolloutSettings


def test_the_training_run_gets_the_bound_the_filter_and_the_version() -> None:
    settings = AgentRolloutSettings.from_args(SimpleNamespace(
        rollout_batch_size=4, agent_max_staleness=2, agent_stale_policy="drop", agent_group_filter="nonzero_std"))
    assert staleness_fields(settings, 7) == {"max_staleness": "2", "rollout_batch_size": "4", "stale_policy": "drop",
                                             "group_filter": "nonzero_std", "policy_version": "7"}
    assert staleness_fields(AgentRolloutSettings.from_args(SimpleNamespace()), None) == {}
    evaluation = start_payload(settings, EvalDataset(name="d", path="/d.jsonl"), "eval-d", "math")
    assert not {"max_staleness", "stale_policy", "group_filter", "policy_version"} & set(evaluation)


@pytest.mark.parametrize(("name", "value", "words"), [
    ("agent_max_staleness", -1, ">= 0"), ("agent_stale_policy", "later", "agent_stale_policy")])
def test_bad_staleness_settings_are_refused(name: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        AgentRolloutSettings.from_args(SimpleNamespace(**{name: value}))


def test_a_steps_staleness_and_filter_metrics() -> None:
    metas = [
        {"staleness": {"min": 0, "mean": 0.5, "max": 1, "over_bound": 0}, "staleness_samples": 4,
         "dynamic_filter": {"zero_std": 2}, "stale_requeued_groups": ["0:a"], "stale_dropped_groups": [],
         "stale_totals": {"wasted_share": 0.1}},
        {"staleness": {"min": 1, "mean": 2.0, "max": 3, "over_bound": 2}, "staleness_samples": 2,
         "dynamic_filter": {"zero_std": 1, "too_long": 1}, "stale_requeued_groups": ["0:b", "1:c"],
         "stale_dropped_groups": ["0:d"], "stale_totals": {"wasted_share": 0.25}},
        {"staleness": {"min": None, "mean": None, "max": None, "over_bound": 0}, "staleness_samples": 0},
    ]
    metrics = rollout_metrics(metas)
    assert metrics["rollout/staleness_min"] == 0 and metrics["rollout/staleness_max"] == 3
    assert metrics["rollout/staleness_mean"] == pytest.approx((0.5 * 4 + 2.0 * 2) / 6), "weighted by samples"
    assert metrics["rollout/staleness_over_bound"] == 2
    assert metrics["rollout/dynamic_filter/drop_zero_std"] == 3 and metrics["rollout/dynamic_filter/drop_too_long"] == 1
    assert metrics["rollout/stale_requeued_groups"] == 3 and metrics["rollout/stale_dropped_groups"] == 1
    assert metrics["rollout/stale_requeued"] == 0.25, "the run's share as of the step's last read that says it"


def test_a_buffer_without_staleness_gives_no_staleness_values() -> None:
    metrics = rollout_metrics([{"total_samples": 2, "num_groups": 1}])
    assert "rollout/staleness_max" not in metrics and "rollout/stale_requeued" not in metrics
    assert metrics["rollout/staleness_over_bound"] == 0
