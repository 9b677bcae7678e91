"""The series a router really exports (router/metrics.py), and checks of PromQL text against them: what the alert
rules (deploy/prometheus-alerts.yaml) and the Grafana dashboard (deploy/grafana-dashboard.json) may name.
No Ray, no network: the series come from a Metrics registry built here."""
from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from router.metrics import Metrics

METRIC = re.compile(r"specpool_[a-z0-9_]+")
SELECTOR = re.compile(r"(specpool_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def exported_series() -> dict[str, set[str]]:
    """{sample name: its label names} of a router's registry, each labelled metric given one series (a labelled
    metric with no series exports no sample) and specpool_worker_replicas set up as the router does."""
    metrics = Metrics()
    metrics.count_replicas({"draft": [], "target": []})
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def exported_families() -> set[str]:
    """The metric families a router exports, by the name their samples share (`specpool_requests`, not
    `specpool_requests_total`)."""
    metrics = Metrics()
    metrics.count_replicas({"draft": [], "target": []})
    return {family.name for family in metrics.registry.collect()}


def unknown_metrics(text: str, series: dict[str, set[str]]) -> list[str]:
    return sorted({name for name in METRIC.findall(text) if name not in series})


def unknown_labels(expr: str, series: dict[str, set[str]]) -> list[str]:
    """Labels matched in a selector that its metric lacks, and labels grouped on (by, without, on, ignoring) that
    no metric of the expression has."""
    wrong = [f"{name}{{{label}}}" for name, matchers in SELECTOR.findall(expr)
             for label in MATCHER.findall(matchers) if label not in series.get(name, set())]
    known = set().union(*(series.get(name, set()) for name in METRIC.findall(expr)))
    grouped = [label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()]
    return wrong + [f"by/without ({label})" for label in grouped if label not in known]


def balanced(expr: str) -> bool:
    """Every bracket of `expr` (outside quoted strings) closed, in order."""
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"[^"]*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and not (stack and stack.pop() == pairs[char]):
            return False
    return not stack
