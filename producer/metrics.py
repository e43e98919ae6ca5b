"""The producer's Prometheus metrics: every name the producer exports is here."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["CONFIRMED", "CONFIRM_SECONDS", "FAILED", "IN_FLIGHT", "PUBLISHED"]

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
