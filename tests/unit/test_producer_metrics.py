"""``observe_runs`` leaves a histogram as one ``observe`` per value would."""

from __future__ import annotations

import pytest
from partq.producer.metrics import observe_runs
from prometheus_client import CollectorRegistry, Histogram


def samples(histogram: Histogram) -> dict[str, float]:
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for metric in histogram.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def test_runs_of_equal_start_times_count_as_one_observation_each() -> None:
    # Given two histograms, and start times in runs (a drained batch shares its time)
    buckets = (0.001, 0.01, 0.1, 1)
    one = Histogram("one", "h", ["stream"], buckets=buckets, registry=CollectorRegistry())
    bulk = Histogram("bulk", "h", ["stream"], buckets=buckets, registry=CollectorRegistry())
    started = [10.0] * 5 + [10.5] * 3 + [10.0] + [12.0] * 7
    now = 12.5
    # When one observes value by value and the other in runs
    for t in started:
        one.labels("s").observe(now - t)
    observe_runs(bulk.labels("s"), now, started)
    observe_runs(bulk.labels("s"), now, [])
    # Then both hold the same counts per bucket, count and sum
    a, b = samples(one), samples(bulk)
    assert a.keys() == {k.replace("bulk", "one", 1) for k in b}
    for key, value in b.items():
        assert a[key.replace("bulk", "one", 1)] == pytest.approx(value)
