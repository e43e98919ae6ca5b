"""The producer's Prometheus metrics: every name the producer exports is here."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["CONFIRMED", "CONFIRM_SECONDS", "FAILED", "IN_FLIGHT", "PUBLISHED", "observe_runs"]

PUBLISHED = Counter(
    "partq_producer_published", "Messages handed to the broker (before confirm)", ["stream"]
)
CONFIRMED = Counter("partq_producer_confirmed", "Messages the broker confirmed", ["stream"])
FAILED = Counter(
    "partq_producer_failed",
    "Messages whose publish failed, by reason (nacked, unroutable, connection, closed)",
    ["stream", "reason"],
)
CONFIRM_SECONDS = Histogram(
    "partq_producer_confirm_seconds",
    "Time from publish to the broker's confirm",
    ["stream"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
IN_FLIGHT = Gauge(
    "partq_producer_in_flight_messages", "Messages published and not yet confirmed", ["stream"]
)


def observe_runs(histogram: Any, now: float, started: list[float]) -> None:
    """``histogram.observe(now - t)`` for each ``t`` in ``started``, one update per run of
    equal values (the messages of one drained batch share their publish time): a lock per
    bucket touched, not per message. Uses ``prometheus_client``'s histogram child layout
    (``_sum``, ``_buckets``, ``_upper_bounds``, as of 0.17-0.26) and falls back to
    ``observe`` without it; ``tests/unit/test_producer_metrics.py`` pins the equality."""
    if not started:
        return
    bulk = hasattr(histogram, "_buckets") and hasattr(histogram, "_upper_bounds")
    run_start, count = started[0], 0
    for value in started:
        if value != run_start:
            _observe(histogram, now - run_start, count, bulk)
            run_start, count = value, 0
        count += 1
    _observe(histogram, now - run_start, count, bulk)


def _observe(histogram: Any, amount: float, count: int, bulk: bool) -> None:
    if not bulk:
        for _ in range(count):
            histogram.observe(amount)
        return
    histogram._sum.inc(amount * count)
    for index, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[index].inc(count)
            break
