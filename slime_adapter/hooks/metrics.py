"""`rollout/` metrics of one trainer step: the buffer's "no filter" view plus token statistics of the samples.

`meta_info` counts (samples, groups, rewards, statuses) are over everything written since the previous
read, so a step's totals are the sums over its reads; `drops` are run totals, so the last read's value is
the current one. Token statistics come from the samples the trainer actually receives.

Staleness: `rollout/staleness_{min,mean,max}` over the step's handed samples (each read's
`meta_info.staleness`, the mean weighted by its versioned samples), `rollout/staleness_over_bound`,
`rollout/stale_requeued` (the run's share of started groups thrown away as stale: requeued or dropped),
`rollout/stale_requeued_groups` and `rollout/stale_dropped_groups` (this step's), and the group filter's
drops as `rollout/dynamic_filter/drop_<reason>` (slime's names).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from slime_adapter.samples.build import BuildStats
from slime_adapter.settings import AgentRolloutSettings

__all__ = ["aggregate_meta_info", "log_raw_info", "rollout_metrics", "rollout_step"]

log = logging.getLogger(__name__)


def aggregate_meta_info(all_meta_info: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sum the per-read `meta_info`s of one step into one no-filter view."""
    metas = [m for m in all_meta_info if m]
    total = sum(int(m.get("total_samples", 0)) for m in metas)
    groups = sum(int(m.get("num_groups", 0)) for m in metas)
    reward_sum = sum(float(m.get("avg_reward", 0.0)) * int(m.get("total_samples", 0)) for m in metas)
    statuses: dict[str, int] = {}
    for m in metas:
        for status, count in (m.get("status_counts") or {}).items():
            statuses[status] = statuses.get(status, 0) + int(count)
    return {
        "total_samples": total,
        "num_groups": groups,
        "avg_group_size": total / groups if groups else 0.0,
        "avg_reward": reward_sum / total if total else 0.0,
        "status_counts": statuses,
        "finished_groups": sum(len(m.get("finished_groups") or []) for m in metas),
        "filtered_groups": sum(len(m.get("filtered_groups") or []) for m in metas),
        "timed_out_groups": sum(_count(m.get("timed_out_groups")) for m in metas),
        "returned_samples": sum(int(m.get("returned_samples", 0)) for m in metas),
        "drops": dict(metas[-1].get("drops") or {}) if metas else {},
        "gateway_forks": dict(metas[-1].get("gateway_forks") or {}) if metas else {},
        "reads": len(metas),
        "staleness": _staleness(metas),
        "dynamic_filter": _sum_dicts(m.get("dynamic_filter") for m in metas),
        "stale_requeued_groups": sum(len(m.get("stale_requeued_groups") or []) for m in metas),
        "stale_dropped_groups": sum(len(m.get("stale_dropped_groups") or []) for m in metas),
        "wasted_share": next((float(m["stale_totals"].get("wasted_share", 0.0)) for m in reversed(metas)
                              if isinstance(m.get("stale_totals"), dict)), None),
    }


def _staleness(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One step's staleness from its reads' `{min, mean, max, over_bound}` summaries."""
    parts = [(m["staleness"], int(m.get("staleness_samples") or 0)) for m in metas
             if isinstance(m.get("staleness"), dict) and m["staleness"].get("max") is not None]
    over = sum(int(m["staleness"].get("over_bound") or 0) for m in metas if isinstance(m.get("staleness"), dict))
    if not parts:
        return {"min": None, "mean": None, "max": None, "over_bound": over}
    weights = [max(n, 1) for _, n in parts]
    mean = sum(float(p["mean"]) * w for (p, _), w in zip(parts, weights)) / sum(weights)
    return {"min": min(p["min"] for p, _ in parts), "mean": mean, "max": max(p["max"] for p, _ in parts),
            "over_bound": over}


def _sum_dicts(items: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for item in items:
        for key, value in (item or {}).items():
            total[str(key)] = total.get(str(key), 0) + int(value)
    return total


def _count(value: Any) -> int:
    """`timed_out_groups` is a list of ids in this buffer; a count in others."""
    if isinstance(value, (list, tuple, set)):
        return len(value)
    return int(value or 0)


def rollout_step(settings: AgentRolloutSettings, rollout_id: int) -> int:
    """slime's x-axis: the rollout id, or the train step when `wandb_always_use_train_step` is set."""
    if settings.wandb_always_use_train_step and settings.global_batch_size:
        return rollout_id * settings.samples_per_step // settings.global_batch_size
    return rollout_id


def rollout_metrics(all_meta_info: Sequence[dict[str, Any]], stats: BuildStats | None = None,
                    filter_drops: dict[str, int] | None = None) -> dict[str, Any]:
    """The `rollout/...` dict of one step (without the step key); `filter_drops` (the adapter's dynamic
    filter, `slime_adapter.hooks.dynamic_filter`) add to the buffer's drops of the same names."""
    agg = aggregate_meta_info(all_meta_info)
    out: dict[str, Any] = {
        "rollout/no_filter/total_samples": agg["total_samples"],
        "rollout/no_filter/avg_reward": agg["avg_reward"],
        "rollout/no_filter/num_groups": agg["num_groups"],
        "rollout/no_filter/avg_group_size": agg["avg_group_size"],
        "rollout/finished_groups": agg["finished_groups"],
        "rollout/filtered_groups": agg["filtered_groups"],
        "rollout/failed_samples": agg["status_counts"].get("failed", 0),
        "rollout/timed_out_groups": agg["timed_out_groups"],
        "rollout/returned_samples": agg["returned_samples"],
    }
    for status, count in sorted(agg["status_counts"].items()):
        out[f"rollout/status/{status}"] = count
    for reason, count in sorted(agg["drops"].items()):
        out[f"rollout/drops/{reason}"] = count
    for reason, count in sorted(agg["gateway_forks"].items()):
        out[f"rollout/gateway_forks/{reason}"] = count
    if agg["gateway_forks"]:
        out["rollout/gateway_forks"] = sum(agg["gateway_forks"].values())
    for reason, count in sorted(agg["dynamic_filter"].items()):
        out[f"rollout/dynamic_filter/drop_{reason}"] = count
    for name, count in (filter_drops or {}).items():
        out[name] = out.get(name, 0) + count
    staleness = agg["staleness"]
    for name in ("min", "mean", "max"):
        if staleness[name] is not None:
            out[f"rollout/staleness_{name}"] = staleness[name]
    out["rollout/staleness_over_bound"] = staleness["over_bound"]
    out["rollout/stale_requeued_groups"] = agg["stale_requeued_groups"]
    out["rollout/stale_dropped_groups"] = agg["stale_dropped_groups"]
    if agg["wasted_share"] is not None:
        out["rollout/stale_requeued"] = agg["wasted_share"]
    if stats is not None:
        lengths = [p["response_tokens"] for p in stats.pieces]
        generated = [p["generated_tokens"] for p in stats.pieces]
        out.update({
            "rollout/samples": stats.samples,
            "rollout/forks": stats.forks,
            "rollout/token_path_records": stats.token_path_records,
            "rollout/retokenized_records": stats.retokenized_records,
            # message path: tokens the edge rule set to 0, records refused (kept with an all-zero mask)
            "rollout/mask_edge_tokens": stats.mask_edge_tokens,
            "rollout/mask_refused": stats.mask_refused,
            "rollout/offpolicy_masked_tokens": stats.offpolicy_masked_tokens,
        })
        if lengths:
            out.update({
                "rollout/response_len/mean": sum(lengths) / len(lengths),
                "rollout/response_len/max": max(lengths),
                "rollout/response_len/min": min(lengths),
                "rollout/generated_tokens/mean": sum(generated) / len(generated),
            })
    return out


def _wandb_run(settings: AgentRolloutSettings) -> Any:
    """slime's wandb run when it made one; otherwise a new one, offline unless an API key is configured."""
    import wandb

    if wandb.run is not None:
        return wandb.run
    if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
        os.environ["WANDB_MODE"] = "offline"  # no key: write locally (`wandb sync` later) instead of failing
    run = wandb.init(project=settings.wandb_project, group=settings.wandb_group, job_type="rollout",
                     dir=os.environ.get("WANDB_DIR"))
    run.define_metric("rollout/step")
    run.define_metric("rollout/*", step_metric="rollout/step")
    return run


def log_raw_info(args: Any, all_meta_info: Sequence[dict[str, Any]], rollout_id: int,
                 stats: BuildStats | None = None, extra: dict[str, Any] | None = None,
                 to_wandb: bool | None = None, filter_drops: dict[str, int] | None = None) -> dict[str, Any]:
    """Log one step's `rollout/` metrics (wandb when `args.use_wandb`, else the log) and return them.

    `stats` (the step's sample-building counts) adds response-length, generated-token, fork and
    retokenization figures; `extra` adds caller-specific `rollout/` values. A wandb failure is logged and never stops training.
    `to_wandb=False` keeps them out of wandb (slime logs them itself when they are returned to it).
    """
    settings = AgentRolloutSettings.from_args(args)
    metrics = rollout_metrics(all_meta_info, stats, filter_drops)
    metrics.update(extra or {})
    metrics["rollout/step"] = rollout_step(settings, rollout_id)
    if settings.use_wandb and to_wandb is not False:
        try:
            _wandb_run(settings).log(metrics)
        except Exception:
            log.exception("logging rollout %d to wandb failed; metrics: %s", rollout_id, metrics)
            return metrics
    log.info("rollout %d: %s", rollout_id, metrics)
    return metrics
