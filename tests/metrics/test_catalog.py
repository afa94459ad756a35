"""The metric names: Prometheus's conventions, bounded labels, and the table of
docs/metrics.md and the Grafana dashboard in step with what is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runcell_celery.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
#: Labels a metric may carry: the configured names, and small fixed sets.
BOUNDED_LABELS = {"limiter", "workload", "outcome", "reason", "operation"}


def test_names_follow_prometheus_conventions() -> None:
    names = [m.name for m in METRICS]
    assert len(set(names)) == len(names)
    for metric in METRICS:
        assert re.fullmatch(r"runcell_[a-z_]+", metric.name), metric.name
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        if metric.kind == "histogram" or "wait" in metric.name or "hold" in metric.name:
            assert metric.name.endswith("_seconds") or metric.kind == "counter", metric.name
        assert not re.search(r"_(ms|milliseconds|minutes)\b", metric.name)


def test_labels_are_bounded_never_a_task_id_or_a_key() -> None:
    for metric in METRICS:
        assert set(metric.labels) <= BOUNDED_LABELS, metric.name
        assert metric.labels[:1] in ((), ("limiter",)), metric.name


def test_the_docs_table_lists_every_metric_with_its_type_and_labels() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    section = page.split("## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(runcell_\w+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|$", section, re.M)
    listed = {
        name: (kind, re.findall(r"`(\w+)`", labels), meaning)
        for name, kind, labels, meaning in rows
    }
    assert list(listed) == [m.name for m in METRICS]
    for metric in METRICS:
        kind, labels, meaning = listed[metric.name]
        assert (kind, tuple(labels), meaning.strip()) == (metric.kind, metric.labels, metric.help)


def test_the_grafana_dashboard_queries_only_exported_metrics_and_shows_each() -> None:
    dashboard = json.loads((ROOT / "example_project" / "grafana-runcell.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = set(re.findall(r"\b(runcell_\w+)", " ".join(exprs)))
    samples = {m.name for m in METRICS} | {
        f"{m.name}_{suffix}"
        for m in METRICS
        if m.kind == "histogram"
        for suffix in ("bucket", "count", "sum")
    }
    assert queried <= samples, queried - samples
    shown = {name.removesuffix("_bucket") for name in queried}
    assert shown == {m.name for m in METRICS}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
