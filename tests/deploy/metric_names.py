"""Which series partq exports, and which partq series a PromQL expression reads.

Exported names come from the metric objects in partq's metrics modules, so a
renamed metric breaks the check of every dashboard panel and rule using it.
A query must name a *series* exactly as Prometheus stores it: a counter's
``partq_x_total``, a histogram's ``partq_y_bucket``/``_sum``/``_count``, a
gauge's bare name. A bare histogram or counter name selects nothing, so it is
reported, as is a suffix that does not belong to the metric's type.
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

# Every module that defines partq metrics (the Spark one imports pyspark: the spark extra).
METRICS_MODULES = (
    "partq.producer.metrics",
    "partq.producer.spark.metrics",
    "partq.coordinator.metrics",
    "partq.consumers.metrics",
)

# The series names prometheus_client exposes for a family of each type.
SERIES_SUFFIXES: Mapping[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME = re.compile(r"(?<![A-Za-z0-9_:])partq_[a-z0-9_]+")


def exported_families(modules: Iterable[str] = METRICS_MODULES) -> dict[str, str]:
    """Family name → type, for every metric object defined in ``modules``."""
    return {family.name: family.type for family, _ in _families(modules)}


def family_labels(modules: Iterable[str] = METRICS_MODULES) -> dict[str, tuple[str, ...]]:
    """Family name → its label names."""
    return {family.name: tuple(metric._labelnames) for family, metric in _families(modules)}


def _families(modules: Iterable[str]) -> Iterator[tuple[Metric, MetricWrapperBase]]:
    for module_name in modules:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                for family in value.describe():
                    yield family, value


def exported_series(families: Mapping[str, str]) -> frozenset[str]:
    return frozenset(
        name + suffix for name, kind in families.items() for suffix in SERIES_SUFFIXES[kind]
    )


def family_of(series: str, families: Mapping[str, str]) -> str | None:
    """The family ``series`` belongs to, or None if it is no series of any."""
    for name, kind in families.items():
        if any(series == name + suffix for suffix in SERIES_SUFFIXES[kind]):
            return name
    return None


def referenced_metrics(expr: str) -> set[str]:
    """partq metric names an expression selects (quoted label values are ignored)."""
    return set(_NAME.findall(_STRING.sub('""', expr)))


def unknown_metrics(expressions: Iterable[tuple[str, str]], exported: frozenset[str]) -> list[str]:
    """One line per (place, name) where a query names a series partq does not export."""
    problems = []
    for where, expr in expressions:
        for name in sorted(referenced_metrics(expr)):
            if name not in exported:
                close = difflib.get_close_matches(name, exported, n=1, cutoff=0.8)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{where}: {name} is not a series partq exports{hint}")
    return problems


def rule_expressions(path: Path) -> Iterator[tuple[str, str]]:
    doc = yaml.safe_load(path.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            yield f"{path.name}: {name}", str(rule["expr"])


def dashboard_expressions(path: Path) -> Iterator[tuple[str, str]]:
    """Every query in a Grafana dashboard: panel targets, variables, annotations."""
    for title, expr in _walk(json.loads(path.read_text()), "dashboard"):
        yield f"{path.name}: {title}", expr


def scaledobject_expressions(path: Path) -> Iterator[tuple[str, str]]:
    doc = yaml.safe_load(path.read_text())
    for trigger in doc["spec"]["triggers"]:
        if trigger["type"] == "prometheus":
            yield f"{path.name}: trigger", str(trigger["metadata"]["query"])


def _walk(node: Any, title: str) -> Iterator[tuple[str, str]]:
    """(title of the nearest panel, query) for every query string under ``node``."""
    if isinstance(node, dict):
        here = repr(node["title"]) if "title" in node else title
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                yield here, value
            else:
                yield from _walk(value, here)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, title)
