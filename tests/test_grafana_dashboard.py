"""deploy/grafana-dashboard.json: a Grafana dashboard of the router's metrics that on-call can import as it is.
Every query parses as PromQL and names only series, and labels, the router exports (router/metrics.py), so a
renamed metric fails here instead of leaving an empty graph; every metric the router exports and every metric an
alert fires on has a graph. Fast: no Ray, no network, no Grafana."""
from __future__ import annotations

import json
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.exported_metrics import METRIC, balanced, exported_families, exported_series, unknown_labels, \
    unknown_metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
PANELS = [panel for panel in DASHBOARD["panels"] if panel["type"] != "row"]
QUERIES = [(panel["title"], target["expr"]) for panel in PANELS for target in panel["targets"]]
TARGET_LABELS = {"instance", "job"}          # what Prometheus adds to every series it scrapes
SERIES = {name: labels | TARGET_LABELS for name, labels in exported_series().items()}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*"}


def as_prometheus_sees_it(expr: str) -> str:
    """The query with Grafana's variables replaced as Grafana replaces them before it asks Prometheus."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def query_id(query: tuple) -> str:
    return f"{query[0]}: {query[1][:60]}"


@pytest.mark.parametrize("query", QUERIES, ids=query_id)
def test_every_query_parses_as_promql(query):
    assert balanced(query[1]), query[1]
    promql_parser.parse(as_prometheus_sees_it(query[1]))


@pytest.mark.parametrize("query", QUERIES, ids=query_id)
def test_every_query_names_only_metrics_and_labels_the_router_exports(query):
    assert METRIC.search(query[1]), "the query names no specpool metric"
    assert unknown_metrics(query[1], SERIES) == []
    assert unknown_labels(query[1], SERIES) == []


@pytest.mark.parametrize("query", QUERIES, ids=query_id)
def test_every_selector_follows_the_router_picker(query):
    """The dashboard's `instance` variable picks the routers shown: a selector that ignored it would mix routers
    the operator filtered out into a graph."""
    selectors = METRIC.findall(query[1])
    assert query[1].count('instance=~"$instance"') == len(selectors), query[1]


def test_every_metric_the_router_exports_has_a_graph():
    graphed = {name for _, expr in QUERIES for name in METRIC.findall(expr)}
    missing = [family for family in sorted(exported_families())
               if not any(name == family or name.startswith(family + "_") for name in graphed)]
    assert missing == [], f"metrics with no panel in deploy/grafana-dashboard.json: {missing}"


def test_every_metric_an_alert_fires_on_has_a_graph():
    """An alert's description sends on-call to the dashboard: what it fired on must be there to look at."""
    rules = [rule for group in yaml.safe_load((DEPLOY / "prometheus-alerts.yaml").read_text())["groups"]
             for rule in group["rules"]]
    graphed = {name for _, expr in QUERIES for name in METRIC.findall(expr)}
    alerted = {name for rule in rules for name in METRIC.findall(rule["expr"])}
    assert alerted - graphed == set()


def test_panels_have_unique_ids_titles_a_description_and_the_chosen_data_source():
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert len({panel["title"] for panel in PANELS}) == len(PANELS)
    for panel in PANELS:
        assert panel["description"].strip() and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_panels_do_not_overlap_on_the_grid():
    cells: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_variables_are_a_prometheus_data_source_and_routers_that_export_replicas():
    variables = {variable["name"]: variable for variable in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]
    assert unknown_metrics(variables["instance"]["definition"], SERIES) == []


def test_the_checks_catch_a_query_that_ignores_the_picker_or_names_a_missing_series():
    assert unknown_metrics('rate(specpool_request_total{instance=~"$instance"}[5m])', SERIES) == [
        "specpool_request_total"]
    assert unknown_labels('sum by (worker) (specpool_worker_active_sessions{instance=~"$instance"})', SERIES) == [
        "by/without (worker)"]
    with pytest.raises(ValueError):
        promql_parser.parse(as_prometheus_sees_it("sum(rate(specpool_requests_total{}[$__rate_interval])"))
