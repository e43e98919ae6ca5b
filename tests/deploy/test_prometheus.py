"""deploy/prometheus: promtool accepts the rules and the compose config; the rules behave."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, run

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

REQUIRED_ALERTS = {
    "PartqUnassignedPartitions",
    "PartqLagGrowing",
    "PartqNoLeader",
    "PartqDeadLetterRate",
    "PartqLeaseRenewalFailures",
}


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_alerting_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_compose_prometheus_config_and_its_rule_files(
    promtool: str,
) -> None:
    result = run(promtool, "check", "config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_each_alert_fires_on_its_failure_and_not_on_a_healthy_stream(promtool: str) -> None:
    # alerts.test.yml feeds series to the rules and states which alerts must fire
    result = run(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_covered_by_a_rule_test() -> None:
    tested = {
        case["alertname"]
        for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in group.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in alerts()} <= tested


def test_the_required_alerts_exist() -> None:
    assert {rule["alert"] for rule in alerts()} >= REQUIRED_ALERTS


@pytest.mark.parametrize("rule", alerts(), ids=lambda rule: rule["alert"])
def test_an_alert_waits_has_a_severity_and_explains_itself(rule: dict[str, Any]) -> None:
    assert rule.get("for"), "an alert without `for:` pages on a single bad scrape"
    assert rule.get("labels", {}).get("severity") in {"critical", "warning", "info"}
    annotations = rule.get("annotations", {})
    assert annotations.get("summary") and annotations.get("description")
