"""deploy/grafana: the dashboard is well formed and shows what operators need."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import metric_names as names
from tests.deploy.conftest import DEPLOY, run

DASHBOARD = DEPLOY / "grafana" / "partq-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# What the dashboard must show, by the series that shows it.
REQUIRED_SERIES = {
    "throughput": {
        "partq_producer_published_total",
        "partq_producer_confirmed_total",
        "partq_consumer_messages_handled_total",
    },
    "lag per partition": {"partq_queue_messages"},
    "owners": {"partq_assignment_info"},
    "rebalances": {"partq_coordinator_rebalances_total"},
    "handoff gaps": {"partq_consumer_handoff_gap_seconds_bucket"},
    "failures": {
        "partq_producer_failed_total",
        "partq_consumer_dead_lettered_total",
        "partq_consumer_lease_renewal_failures_total",
    },
    "leader": {"partq_coordinator_is_leader"},
}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(nodes: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in nodes:
        yield panel
        yield from panels(panel.get("panels", []))


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    all_panels = list(panels(dashboard()["panels"]))
    ids = [panel["id"] for panel in all_panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in all_panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']!r} overlaps another panel"
        cells |= area


def test_every_query_uses_the_templated_prometheus_datasource() -> None:
    doc = dashboard()
    variables = {var["name"]: var for var in doc["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in panels(doc["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_every_query_of_a_metric_with_a_stream_label_filters_on_the_stream_variable() -> None:
    families = names.exported_families()
    labels = names.family_labels()
    for where, expr in names.dashboard_expressions(DASHBOARD):
        if expr.startswith("label_values("):
            continue
        with_stream = [
            name
            for name in names.referenced_metrics(expr)
            if "stream" in labels.get(names.family_of(name, families) or "", ())
        ]
        if with_stream:
            assert 'stream=~"$stream"' in expr, f"{where}: {expr}"


def test_every_dashboard_query_is_valid_promql(tmp_path: Path, promtool: str) -> None:
    # Given the queries with Grafana's variables replaced as Grafana would
    grafana_variables = {"$__rate_interval": "1m", "$stream": ".*"}
    rules = []
    for index, (where, query) in enumerate(names.dashboard_expressions(DASHBOARD)):
        if query.startswith("label_values("):  # Grafana's own function, not PromQL
            continue
        expr = query
        for variable, value in grafana_variables.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{where}: unknown variable in {query}"
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))

    # When promtool parses them, then it accepts every one
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("topic", sorted(REQUIRED_SERIES))
def test_the_dashboard_shows(topic: str) -> None:
    queried = {
        name
        for _, expr in names.dashboard_expressions(DASHBOARD)
        for name in names.referenced_metrics(expr)
    }
    assert REQUIRED_SERIES[topic] <= queried


def test_grafana_provisions_the_compose_prometheus_by_uid() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (source,) = yaml.safe_load(provisioning.read_text())["datasources"]
    assert source["type"] == "prometheus"
    assert source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090"
