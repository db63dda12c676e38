"""Write `docs/grafana-dashboard.json`: a Grafana dashboard over the buffer's `/metrics`.

    python scripts/grafana_dashboard.py [docs/grafana-dashboard.json]

Import it in Grafana (Dashboards > New > Import), pick the Prometheus data source that scrapes the
buffer; the `run_id` variable lists the live runs. A test checks that the committed file is what this
script writes and that every metric it queries is one `/metrics` serves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
RUN = 'run_id=~"$run_id"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def panel(title: str, targets: list[tuple[str, str]], *, unit: str = "short", kind: str = "timeseries",
          description: str = "", stack: bool = False) -> dict[str, Any]:
    custom: dict[str, Any] = {"lineWidth": 2, "fillOpacity": 10}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, **({"custom": custom} if kind == "timeseries" else {})},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
    }


def quantiles(metric: str, by: str = "run_id") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{RUN}}}[$__rate_interval])))",
             f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.95, 0.99)]


def panels() -> list[dict[str, Any]]:
    finished = f'sum by (run_id) (rollout_buffer_tasks{{{RUN},state=~"done|failed|skipped"}})'
    return [
        panel("Progress", [(f"{finished} / sum by (run_id) (rollout_buffer_tasks_planned{{{RUN}}})", "{{run_id}}")],
              unit="percentunit", kind="stat", description="Rollouts finished out of the run's planned rollouts"),
        panel("Groups ready / leased now", [(f'sum by (run_id) (rollout_buffer_groups{{{RUN},state="ready"}})',
                                             "ready {{run_id}}"),
                                            (f'sum by (run_id) (rollout_buffer_groups{{{RUN},state="leased"}})',
                                             "leased {{run_id}}")], kind="stat"),
        panel("Tasks by state", [(f"rollout_buffer_tasks{{{RUN}}}", "{{state}} {{run_id}}")]),
        panel("Groups by state", [(f"rollout_buffer_groups{{{RUN}}}", "{{state}} {{run_id}}")],
              description="pending, ready and leased now; handed, filtered, timed_out, completed so far"),
        panel("Rollouts per second", [
            (f"sum by (run_id) (rate(rollout_buffer_tasks{{{RUN},state=~\"done|failed\"}}[$__rate_interval]))",
             "finished {{run_id}}"),
            (f"sum by (run_id) (rate(rollout_buffer_samples_handed_total{{{RUN}}}[$__rate_interval]))",
             "handed over {{run_id}}")], unit="ops"),
        panel("Tokens generated per second",
              [(f"rate(rollout_buffer_generated_tokens_total{{{RUN}}}[$__rate_interval])", "{{run_id}}")], unit="short"),
        panel("Rollout duration", quantiles("rollout_buffer_rollout_duration_seconds"), unit="s"),
        panel("Engine call latency", quantiles("rollout_buffer_engine_call_duration_seconds"), unit="s"),
        panel("Time to hand-over", quantiles("rollout_buffer_handover_delay_seconds"), unit="s",
              description="From a group's last record to the read that handed it over"),
        panel("Staleness (policy versions)", [
            *quantiles("rollout_buffer_staleness_versions"),
            (f"sum by (run_id) (rate(rollout_buffer_staleness_versions_sum{{{RUN}}}[$__rate_interval])) / "
             f"sum by (run_id) (rate(rollout_buffer_staleness_versions_count{{{RUN}}}[$__rate_interval]))",
             "mean {{run_id}}")]),
        panel("Stale groups by action",
              [(f"sum by (action) (increase(rollout_buffer_stale_groups_total{{{RUN}}}[$__rate_interval]))",
                "{{action}}")], stack=True),
        panel("Failed rollouts by error type",
              [(f"sum by (error_type) (increase(rollout_buffer_rollout_failures_total{{{RUN}}}[$__rate_interval]))",
                "{{error_type}}")], stack=True,
              description="The first example of each type: GET /runs/{run_id} or the buffer's dashboard"),
        panel("Drops by reason",
              [(f"sum by (reason) (increase(rollout_buffer_drops_total{{{RUN}}}[$__rate_interval]))", "{{reason}}")],
              stack=True),
        panel("Leases", [
            (f"sum(increase(rollout_buffer_lease_expiries_total{{{RUN}}}[$__rate_interval]))", "expired"),
            (f"sum(increase(rollout_buffer_batches_acked_total{{{RUN}}}[$__rate_interval]))", "acked"),
            (f"sum(increase(rollout_buffer_late_acks_total{{{RUN}}}[$__rate_interval]))", "late acks")]),
        panel("Engine calls and retries", [
            (f"sum(rate(rollout_buffer_engine_calls_total{{{RUN}}}[$__rate_interval]))", "calls/s"),
            (f"sum(rate(rollout_buffer_engine_retries_total{{{RUN}}}[$__rate_interval]))", "retries/s"),
            (f"sum(rate(rollout_buffer_engine_abort_continuations_total{{{RUN}}}[$__rate_interval]))",
             "abort continuations/s")], unit="ops"),
        panel("Records written by status",
              [(f"sum by (status) (rate(rollout_buffer_records_written_total{{{RUN}}}[$__rate_interval]))",
                "{{status}}")], unit="ops", stack=True),
    ]


def dashboard() -> dict[str, Any]:
    laid_out, y = [], 0
    items = panels()
    for row in range(0, len(items), 2):  # two panels a row, each row as tall as its taller panel
        pair = items[row:row + 2]
        height = max(4 if item["type"] == "stat" else 8 for item in pair)
        for column, item in enumerate(pair):
            laid_out.append({"id": row + column + 1, "gridPos": {"x": column * 12, "y": y, "w": 12, "h": height},
                             **item})
        y += height
    return {
        "title": "rollout-buffer", "uid": "rollout-buffer", "tags": ["rollout-buffer", "rl"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"},
            {"type": "query", "name": "run_id", "label": "run", "datasource": DATASOURCE, "multi": True,
             "includeAll": True, "allValue": ".*", "refresh": 2,
             "query": {"query": "label_values(rollout_buffer_run_info, run_id)", "refId": "run_id"},
             "definition": "label_values(rollout_buffer_run_info, run_id)"},
        ]},
        "panels": laid_out,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    print(f"wrote {out}")
