"""Every metric a dashboard panel, an alert or the KEDA example queries is one partq exports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import metric_names as names
from tests.deploy.conftest import DEPLOY, run

RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "partq-dashboard.json"
SCALEDOBJECT = DEPLOY / "k8s" / "examples" / "keda-scaledobject.yaml"


def all_queries() -> list[tuple[str, str]]:
    return [
        *names.rule_expressions(RULES),
        *names.dashboard_expressions(DASHBOARD),
        *names.scaledobject_expressions(SCALEDOBJECT),
    ]


def test_the_metrics_modules_define_partq_metrics() -> None:
    found = names.exported_families()
    assert len(found) >= 20
    assert all(name.startswith("partq_") for name in found)
    # The names as stored: no type suffix in the family name
    assert found["partq_producer_published"] == "counter"
    assert found["partq_consumer_handoff_gap_seconds"] == "histogram"
    assert found["partq_queue_messages"] == "gauge"
    assert found["partq_spark_batch_duration_seconds"] == "histogram"


def test_every_queried_metric_is_exported() -> None:
    # Given the series partq exports and every query in deploy/
    exported = names.exported_series(names.exported_families())
    queries = all_queries()
    assert len(queries) > 40

    # When each query's metric names are looked up
    problems = names.unknown_metrics(queries, exported)

    # Then none is unknown
    assert not problems, "\n".join(problems)


def test_the_check_rejects_misspelt_and_mis_suffixed_names(tmp_path: Path, promtool: str) -> None:
    # Given a rules file promtool accepts, whose queries name series partq does not export
    rules = tmp_path / "wrong.yml"
    rules.write_text(
        """
groups:
  - name: wrong
    rules:
      - alert: Misspelt
        expr: rate(partq_consumer_mesages_handled_total[5m]) > 0
      - alert: CounterWithoutTotal
        expr: rate(partq_producer_published[5m]) > 0
      - alert: GaugeWithCounterSuffix
        expr: partq_coordinator_is_leader_total == 0
      - alert: BareHistogram
        expr: partq_consumer_handoff_gap_seconds > 1
      - alert: Fine
        expr: partq_queue_messages{queue="partq_not_a_metric"} > 1
"""
    )
    assert run(promtool, "check", "rules", str(rules)).returncode == 0

    # When the same check runs on it
    problems = names.unknown_metrics(
        names.rule_expressions(rules), names.exported_series(names.exported_families())
    )

    # Then each wrong name is reported, and the correct query and label value are not
    assert problems == [
        "wrong.yml: Misspelt: partq_consumer_mesages_handled_total is not a series partq"
        " exports (did you mean partq_consumer_messages_handled_total?)",
        "wrong.yml: CounterWithoutTotal: partq_producer_published is not a series partq"
        " exports (did you mean partq_producer_published_total?)",
        "wrong.yml: GaugeWithCounterSuffix: partq_coordinator_is_leader_total is not a"
        " series partq exports (did you mean partq_coordinator_is_leader?)",
        "wrong.yml: BareHistogram: partq_consumer_handoff_gap_seconds is not a series partq"
        " exports (did you mean partq_consumer_handoff_gap_seconds_sum?)",
    ]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            "histogram_quantile(0.99, sum by (le) (rate(partq_consumer_handoff_gap_seconds_bucket"
            '{stream=~"$stream"}[5m])))',
            {"partq_consumer_handoff_gap_seconds_bucket"},
        ),
        (
            "partq_coordinator_partitions_unassigned and on (job, instance) "
            "(partq_coordinator_is_leader == 1)",
            {"partq_coordinator_partitions_unassigned", "partq_coordinator_is_leader"},
        ),
        ('up{job="partq_consumer"}', set()),
        ("record:partq_queue_messages:sum", set()),
        ("label_values(partq_coordinator_members, stream)", {"partq_coordinator_members"}),
    ],
)
def test_referenced_metrics_reads_names_not_label_values(expr: str, expected: set[str]) -> None:
    assert names.referenced_metrics(expr) == expected


def test_the_dashboard_shows_every_metric_partq_exports() -> None:
    # A metric nobody can see is a metric nobody will notice: add a panel with it.
    known = names.exported_families()
    shown = {
        names.family_of(name, known)
        for _, expr in names.dashboard_expressions(DASHBOARD)
        for name in names.referenced_metrics(expr)
    }
    assert sorted(set(known) - shown) == []
