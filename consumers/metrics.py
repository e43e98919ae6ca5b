"""The consumer daemon's Prometheus metrics: every name the consumer exports is here."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CONCURRENCY",
    "DEAD_LETTERED",
    "HANDLED",
    "HANDLER_SECONDS",
    "HANDOFFS",
    "HANDOFF_GAP_SECONDS",
    "HEADER_PROBLEMS",
    "IN_FLIGHT",
    "IN_FLIGHT_MEMBER",
    "KEY_WAIT_SECONDS",
    "LEASE_RENEWAL_FAILURES",
    "PARKING_STALLED",
    "PARK_FAILURES",
    "PARTITIONS_OWNED",
    "PARTITIONS_PAUSED",
    "REDELIVERIES",
    "STALLED",
    "STALLS",
    "TAKEOVERS",
    "WORKER_FAILURES",
]

HANDLED = Counter(
    "partq_consumer_messages_handled",
    "Messages handled, by outcome (ok, retry, dead_lettered)",
    ["stream", "member", "outcome"],
)
HANDLER_SECONDS = Histogram(
    "partq_consumer_handler_seconds",
    "Time the handler took per message",
    ["stream", "member"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PARTITIONS_OWNED = Gauge(
    "partq_consumer_partitions_owned", "Partitions this member consumes now", ["stream", "member"]
)
TAKEOVERS = Counter(
    "partq_consumer_takeovers",
    "Partitions this member took over as hot standby when their owner's connection died",
    ["stream", "member"],
)
PARTITIONS_PAUSED = Gauge(
    "partq_consumer_partitions_paused",
    "Partitions this member owns but does not consume: an operator paused them",
    ["stream", "member"],
)
HANDOFFS = Counter(
    "partq_consumer_handoffs",
    "Partition handoffs by direction (acquired, released)",
    ["stream", "member", "direction"],
)
HANDOFF_GAP_SECONDS = Histogram(
    "partq_consumer_handoff_gap_seconds",
    "From the previous owner's release of a partition to this member's subscription",
    ["stream", "member"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REDELIVERIES = Counter(
    "partq_consumer_redeliveries",
    "Deliveries flagged redelivered by the broker",
    ["stream", "member"],
)
PARKED = Counter(
    "partq_consumer_parked",
    "Messages moved to their key's parking queue (the one that failed, and every later one of a"
    " parked key)",
    ["stream", "member"],
)
PARK_FAILURES = Counter(
    "partq_consumer_park_failures",
    "Failed attempts to park a message (etcd or RabbitMQ refused it): its partition waits and "
    "tries again",
    ["stream", "member"],
)
PARKING_STALLED = Gauge(
    "partq_consumer_parking_stalled_partitions",
    "Partitions waiting because their worker cannot park a message now (/readyz is false "
    "meanwhile)",
    ["stream", "member"],
)
REDRIVES = Counter(
    "partq_consumer_redrives",
    "Parked keys replayed through the handler and unparked (partq dlq redrive)",
    ["stream", "member"],
)
DEAD_LETTERED = Counter(
    "partq_consumer_dead_lettered",
    "Messages sent to the dead-letter queue (retries exhausted, malformed headers, timeout)",
    ["stream", "member"],
)
STALLED = Gauge(
    "partq_consumer_stalled_partitions",
    "Owned partitions whose worker has waited past the stall bound while their queue has "
    "messages ready: RabbitMQ is not delivering them",
    ["stream", "member"],
)
STALLS = Counter(
    "partq_consumer_stalls",
    "Stalls begun: an owned partition with messages ready and nothing delivered past the bound",
    ["stream", "member"],
)
LEASE_RENEWAL_FAILURES = Counter(
    "partq_consumer_lease_renewal_failures", "Failed lease keepalives", ["stream", "member"]
)
HEADER_PROBLEMS = Counter(
    "partq_consumer_header_problems",
    "Deliveries whose partq headers are malformed (dead-lettered unhandled), name another "
    "partition (handled), are a control message from a user that may not send one "
    "(dead-lettered unobeyed) or, found by a redrive in a key's parking queue, are not that "
    "key's parked messages (dead-lettered unhandled), by problem (malformed, wrong_partition, "
    "forged_control, foreign_parked)",
    ["stream", "member", "problem"],
)
WORKER_FAILURES = Counter(
    "partq_consumer_worker_failures",
    "Partition workers that stopped for good, by reason (crash: an unexpected error; "
    "handler_timeout: a handler ran past --handler-timeout). Each makes the member leave "
    "the group and exit non-zero",
    ["stream", "member", "reason"],
)
CONCURRENCY = Gauge(
    "partq_consumer_concurrency",
    "The member's --concurrency: messages of different keys it may handle at once",
    ["stream", "member"],
)
IN_FLIGHT = Gauge(
    "partq_consumer_in_flight",
    "Messages of the partition in a handler now (--concurrency above 1)",
    ["stream", "member", "partition"],
)
IN_FLIGHT_MEMBER = Gauge(
    "partq_consumer_in_flight_member",
    "Messages of the member in a handler now (at most --concurrency)",
    ["stream", "member"],
)
KEY_WAIT_SECONDS = Gauge(
    "partq_consumer_key_wait_seconds",
    "Seconds the longest-waiting message has waited behind an earlier message of its key "
    "(--concurrency above 1), as of the last load report",
    ["stream", "member"],
)
