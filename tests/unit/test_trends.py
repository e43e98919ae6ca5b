"""The status page's trends: a bounded ring of samples, drawn as inline SVG."""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from partq.coordinator.ops.charts import charts_html
from partq.coordinator.ops.trends import Sample, Trends, sample_of


def report(partitions: int, owners: dict[int, str], handled: float = 10.0) -> dict[str, Any]:
    rows = [
        {"partition": p, "messages": p * 2, "owner": owners.get(p), "handled_per_s": handled}
        for p in range(partitions)
    ]
    members = sorted(set(owners.values()))
    return {
        "rows": rows,
        "members": [{"id": m, "handled_per_s": handled * 2} for m in members],
    }


def test_the_ring_keeps_the_window_and_no_more() -> None:
    # Given trends over 900 s sampled every 5 s
    trends = Trends(window=900.0, every=5.0)
    # When an hour of samples arrives, every second (as page loads may)
    for second in range(3600):
        trends.record(Sample(float(second), {0: second}, {}, {}, {}))
    # Then one sample per 5 s of the last 900 s is kept, and the ring never held more
    kept = trends.samples(now=3599.0)
    assert [s.at for s in kept] == [float(t) for t in range(2700, 3600, 5)]
    assert len(trends._samples) == 181  # the ring's bound: window / every + 1
    assert not trends.due(3599.0) and trends.due(3600.0)


def test_a_sample_sums_members_and_caps_partitions() -> None:
    owners = {p: ("a" if p % 2 else "b") for p in range(100)}
    sample = sample_of(report(100, owners), at=1.0, max_partitions=64)
    assert sorted(sample.partition_depth) == list(range(64))
    assert sample.member_depth == {
        "a": sum(p * 2 for p in range(1, 100, 2)),
        "b": sum(p * 2 for p in range(0, 100, 2)),
    }
    assert sample.member_handled == {"a": 20.0, "b": 20.0}


def test_the_charts_draw_one_line_per_series_with_every_sample() -> None:
    owners = {0: "obs-<a>", 1: "obs-b", 2: "obs-b"}
    samples = [sample_of(report(3, owners, handled=t), at=float(t)) for t in range(0, 300, 5)]
    page = charts_html(samples, now=300.0, window=900.0)
    charts = re.findall(r"<svg class='chart' data-chart='([a-z-]+)' data-series='(\d+)'", page)
    assert charts == [
        ("member-handled", "2"),
        ("member-depth", "2"),
        ("partition-handled", "3"),
        ("partition-depth", "3"),
    ]
    lines = re.findall(r"<polyline class='series' data-name='([^']+)' data-points='(\d+)'", page)
    assert len(lines) == 10
    assert all(points == str(len(samples)) for _, points in lines)
    assert "obs-&lt;a&gt;" in page and "obs-<a>" not in page
    assert "<script" not in page and "style=" not in page


def test_no_samples_draws_empty_charts() -> None:
    page = charts_html([], now=0.0, window=900.0)
    assert page.count("<svg class='chart'") == 4
    assert "<polyline" not in page


def test_a_value_that_is_not_finite_is_left_out_of_the_charts() -> None:
    """Issue 43, item 1: an infinite rate made the axis scaling loop for ever (and NaN raised)."""
    bad = [math.inf, -math.inf, math.nan]
    samples = [
        Sample(float(t), {0: 5}, {0: bad[t % 3], 1: 2.0}, {"a": 5}, {"a": bad[t % 3], "b": 1.0})
        for t in range(6)
    ]
    pages: list[str] = []
    drawing = threading.Thread(
        target=lambda: pages.append(charts_html(samples, now=10.0, window=900.0)), daemon=True
    )
    drawing.start()
    drawing.join(timeout=5)
    assert pages, "the charts never finished"
    handled = [f for f in pages[0].split("<figure") if "handled per second" in f]
    lines = [
        dict(re.findall(r"<polyline class='series' data-name='([^']+)' data-points='(\d+)'", f))
        for f in handled
    ]
    # the finite series are whole; the one whose every value was not finite is not drawn
    assert lines == [{"b": "6"}, {"p1": "6"}]
    assert "inf" not in pages[0] and "nan" not in pages[0]
