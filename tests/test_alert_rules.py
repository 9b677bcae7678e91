"""deploy/prometheus-alerts.yaml: a well-formed Prometheus rule file whose every rule names only metrics, and labels,
that the router really exports (router/metrics.py), so an alert cannot go silent on a misspelt or renamed series.
Fast: no Ray, no network; the exported series come from a Metrics registry built here."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.exported_metrics import METRIC, balanced, exported_series, unknown_labels, unknown_metrics

RULES_FILE = Path(__file__).resolve().parent.parent / "deploy" / "prometheus-alerts.yaml"
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def load_rules() -> list[dict]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


RULES = load_rules()
SERIES = exported_series()


def rule_id(rule: dict) -> str:
    return rule.get("alert", "?")


def test_the_rule_file_has_the_alerts_on_call_needs():
    assert {rule["alert"] for rule in RULES} >= {
        "SpecpoolNoTargetReplicaReady", "SpecpoolWorkerReplicaDown", "SpecpoolShedsLoad", "SpecpoolHighErrorRatio",
        "SpecpoolQueueNotDraining", "SpecpoolSlowTimeToFirstToken", "SpecpoolDraftAcceptanceCollapsed"}
    assert len({rule["alert"] for rule in RULES}) == len(RULES), "alert names repeat"


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_rule_has_an_expression_a_duration_a_severity_and_a_summary_and_description(rule):
    assert rule["alert"] and isinstance(rule["expr"], str) and rule["expr"].strip()
    assert DURATION.match(str(rule["for"])), rule["for"]
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip()


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_alert_expression_names_metrics_the_router_exports(rule):
    assert METRIC.search(rule["expr"]), "the expression names no specpool metric"
    assert unknown_metrics(rule["expr"], SERIES) == []


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_label_an_alert_selects_or_groups_by_is_one_its_metric_has(rule):
    assert unknown_labels(rule["expr"], SERIES) == []


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_metrics_named_in_summaries_and_descriptions_exist_too(rule):
    assert unknown_metrics(" ".join(rule["annotations"].values()), SERIES) == []


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_ratio_is_guarded_against_no_traffic(rule):
    """A division is paired with `and <denominator> > 0`, so an idle router (0/0) neither fires nor confuses."""
    if "/" in rule["expr"]:
        assert re.search(r"\band\b[^/]*>\s*0\s*$", rule["expr"].strip()), rule["expr"]


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_every_expression_parses_as_promql(rule):
    """PromQL syntax, checked by a PromQL parser (promql-parser, the Rust parser's Python binding) on every
    machine; promtool, below, checks the whole file where Prometheus is installed."""
    assert balanced(rule["expr"]), rule["expr"]
    promql_parser.parse(rule["expr"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus's) not installed")
def test_promtool_accepts_the_rule_file():
    """PromQL syntax, checked by Prometheus itself where it is installed (Debian: apt-get install prometheus)."""
    done = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_checks_catch_a_misspelt_metric_and_a_label_it_does_not_have():
    assert unknown_metrics('rate(specpool_request_total{code="OK"}[5m]) > 0', SERIES) == ["specpool_request_total"]
    assert unknown_metrics("specpool_queued_requests > 0", SERIES) == []
    assert unknown_labels('specpool_worker_replicas{pool="target", status="ready"} == 0', SERIES) == [
        "specpool_worker_replicas{status}"]
    assert unknown_labels("sum by (pool) (rate(specpool_requests_total[5m]))", SERIES) == ["by/without (pool)"]
    assert not balanced("sum(rate(specpool_requests_total[5m])") and balanced("sum(rate(specpool_requests_total[5m]))")
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (code) rate(specpool_requests_total[5m])")


def test_the_registry_exports_the_series_the_rules_rely_on():
    """Guards the test itself: the registry built above has the labelled and callback series."""
    assert SERIES["specpool_requests_total"] == {"code"}
    assert SERIES["specpool_worker_replicas"] == {"pool", "state"}
    assert "le" in SERIES["specpool_time_to_first_token_seconds_bucket"]
    assert "specpool_spec_decode_num_draft_tokens_total" in SERIES
