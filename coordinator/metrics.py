"""The coordinator's Prometheus metrics: every name the coordinator exports is here.

Consumers count ``partq_etcd_malformed_values`` too (their
:class:`partq.coordinator.store.group.Group`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "ASSIGNMENT_INFO",
    "CLAIMS_UNBOUND",
    "ETCD_SECONDS",
    "FAILURES",
    "FORGED_REMOVED",
    "IMBALANCE",
    "IS_LEADER",
    "LOAD_SPREAD",
    "MALFORMED_VALUES",
    "MEMBERS",
    "PARTITIONS_IN_MOTION",
    "PARTITIONS_MOVED",
    "PARTITIONS_UNASSIGNED",
    "QUEUE_MESSAGES",
    "REBALANCES",
]

IS_LEADER = Gauge(
    "partq_coordinator_is_leader", "1 while this coordinator leads the stream", ["stream"]
)
LOAD_SPREAD = Gauge(
    "partq_coordinator_load_spread",
    "The most loaded member's load over the mean member load (1: even), from the members' "
    "load reports and the queue depths; exported by the leader with --balance load",
    ["stream"],
)
MEMBERS = Gauge("partq_coordinator_members", "Live consumer members of the stream", ["stream"])
PARTITIONS_UNASSIGNED = Gauge(
    "partq_coordinator_partitions_unassigned",
    "Partitions with no owner in the assignment",
    ["stream"],
)
PARTITIONS_IN_MOTION = Gauge(
    "partq_coordinator_partitions_in_motion",
    "Partitions assigned to a member that has not claimed them yet",
    ["stream"],
)
REBALANCES = Counter(
    "partq_coordinator_rebalances",
    "Assignments written, by reason (join, leave, manual, move, drain, startup)",
    ["stream", "reason"],
)
PARTITIONS_MOVED = Counter(
    "partq_coordinator_partitions_moved", "Partitions whose owner changed", ["stream"]
)
CLAIMS_UNBOUND = Gauge(
    "partq_claims_unbound",
    "Claims not on their member's lease: forged ones (on no lease, or on another live "
    "member's; ignored by every reader, deleted by the leader) and a restarted member's "
    "leftovers (honoured until their lease ends)",
    ["stream"],
)
FORGED_REMOVED = Counter(
    "partq_forged_removed",
    "Keys partq never writes that the leader deleted, by kind: claims not on their "
    "member's lease, parked records not written by the partition's holder",
    ["stream", "kind"],
)
PARKED_KEYS = Gauge(
    "partq_parked_keys",
    "Keys parked after a message exhausted its retries: their messages wait for "
    "`partq dlq redrive`",
    ["stream"],
)
IMBALANCE = Gauge(
    "partq_coordinator_imbalance_partitions",
    "Largest distance of a member's partition count from its quota",
    ["stream"],
)
ETCD_SECONDS = Histogram(
    "partq_etcd_request_seconds",
    "Latency of etcd requests made by partq",
    ["operation"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
MALFORMED_VALUES = Counter(
    "partq_etcd_malformed_values",
    "Values under a stream's etcd keys that partq did not write (not JSON, or the wrong "
    "shape), by kind of key: ignored as if absent; counted once per key and revision",
    ["stream", "kind"],
)
FAILURES = Counter(
    "partq_coordinator_failures",
    "Unexpected errors that ended a coordinator's campaign for a stream, by exception type "
    "(it campaigns again after a backoff)",
    ["stream", "error"],
)
ASSIGNMENT_INFO = Gauge(
    "partq_assignment_info",
    "1 for each partition's current owner; join with RabbitMQ's queue metrics on `queue`",
    ["stream", "partition", "member", "queue"],
)
QUEUE_MESSAGES = Gauge(
    "partq_queue_messages",
    "Messages ready in a partition queue (passive queue.declare)",
    ["stream", "partition", "queue"],
)
