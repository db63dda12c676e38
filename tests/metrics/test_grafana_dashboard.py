"""`docs/grafana-dashboard.json` is what `scripts/grafana_dashboard.py` writes, its queries are valid PromQL,
and every metric they name is one `/metrics` really serves."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client.parser import text_string_to_metric_families

from rollout_buffer.metrics.histograms import ENGINE_CALL, HANDOVER_DELAY, ROLLOUT_DURATION
from rollout_buffer.metrics.prometheus import render
from rollout_buffer.metrics.snapshot import snapshot_runs
from rollout_buffer.store.store import Store

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "docs" / "grafana-dashboard.json"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", REPO / "scripts" / "grafana_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_committed_dashboard_is_the_scripts_output() -> None:
    assert COMMITTED.read_text() == _script().render(), "run: python scripts/grafana_dashboard.py"


def test_every_query_parses_as_promql() -> None:
    dashboard = json.loads(COMMITTED.read_text())
    assert len(dashboard["panels"]) >= 12 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for expr in _queries(dashboard):
        if expr.startswith("label_values("):  # a Grafana template function, not PromQL
            continue
        promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$run_id", ".*"))


async def test_every_metric_a_panel_queries_is_served(redis_store: Store) -> None:
    await redis_store.create_run("r", {}, group_size=2, num_epoch=1, task_type="t")
    observed: Counter[str] = Counter()
    for spec in (ENGINE_CALL, ROLLOUT_DURATION, HANDOVER_DELAY):
        spec.observe(observed, 1.0)
    await redis_store.incr_stats("r", {"staleness_hist:1": 1, "stale_dropped_groups": 1, "drop:late_write": 1,
                                       "rollout_errors:E": 1, "status:completed": 1, **observed})
    served = {sample.name for family in text_string_to_metric_families(
        render(await snapshot_runs(redis_store), "r", "0").decode()) for sample in family.samples}
    used = {name for expr in _queries(json.loads(COMMITTED.read_text()))
            for name in re.findall(r"\brollout_buffer_[a-z_]+", expr)}
    assert used and used <= served, sorted(used - served)
