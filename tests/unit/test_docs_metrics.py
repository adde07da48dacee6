"""The metrics page (docs/metrics.md) and the sample Grafana dashboard against the code:
every metric listed once with its type and labels, nothing listed that is not exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

from celery_fenced import metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\| `(celery_fenced_\w+)` \| (\w+) \| ([^|]*) \| (.+) \|$", re.MULTILINE)


def exported(metric: metrics.Metric) -> str:
    return f"{metric.name}_total" if metric.type == "counter" else metric.name


def test_every_metric_is_documented_once_with_its_type_and_labels() -> None:
    rows = ROW.findall((DOCS / "metrics.md").read_text())
    documented = {name: (kind, labels.strip()) for name, kind, labels, _ in rows}
    assert len(rows) == len(documented), "a metric is listed twice"
    expected = {
        exported(m): (m.type, ", ".join(f"`{label}`" for label in m.labels) or "-")
        for m in (*metrics.METRICS, *metrics.DATABASE_METRICS)
    }
    assert documented == expected


def test_the_dashboard_only_queries_exported_metrics() -> None:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"celery_fenced_\w+", target["expr"]))
    series = {exported(m) for m in (*metrics.METRICS, *metrics.DATABASE_METRICS)}
    histograms = {
        f"{m.name}_{suffix}"
        for m in metrics.METRICS
        if m.type == "histogram"
        for suffix in ("bucket", "sum", "count")
    }
    assert names
    assert names <= series | histograms, names - series - histograms
