"""The arguments partq declares a stream's queues with: partitions, parking, dead letters.

Queue arguments cannot change once a queue exists, so a redeclare with other ones is
refused: :func:`earlier_arguments` names those partq 0.1.0 declared (accepted as found),
and :func:`upgrade_policy_command` the policy that gives such queues what they lack.
Declaring them is :mod:`partq.producer.topology`'s.

Threads. Pure functions of a spec: any thread.
"""

from __future__ import annotations

import json
from typing import Any

import pika.exceptions
from partq.producer.contract import QUORUM_DELIVERY_LIMIT, StreamSpec, queue_pattern

__all__ = [
    "dead_letter_arguments",
    "dead_letter_queue_arguments",
    "earlier_arguments",
    "lacks_delivery_limit",
    "park_queue_arguments",
    "queue_arguments",
    "upgrade_policy_command",
]


def queue_arguments(spec: StreamSpec) -> dict[str, Any]:
    """The arguments of every partition queue of ``spec`` (a redeclare with them is a no-op)."""
    arguments: dict[str, Any] = {"x-single-active-consumer": True, "x-queue-type": spec.queue_type}
    if spec.queue_type == "quorum":  # see QUORUM_DELIVERY_LIMIT: returns to the head, never dropped
        arguments.update(dead_letter_arguments(spec))
        arguments["x-delivery-limit"] = QUORUM_DELIVERY_LIMIT
        if spec.replicas is not None:  # checked on every redeclare: it lives in the spec
            arguments["x-quorum-initial-group-size"] = spec.replicas
    return arguments


def park_queue_arguments(spec: StreamSpec) -> dict[str, Any]:
    """A key's parking queue: a partition queue's arguments without single-active-consumer
    (a replay reads it with basic.get; a returned message goes back to its head)."""
    arguments = queue_arguments(spec)
    del arguments["x-single-active-consumer"]
    return arguments


def dead_letter_arguments(spec: StreamSpec) -> dict[str, Any]:
    """Dead letters go through the stream's own exchange (declaring a queue needs write
    access to its dead-letter exchange: the default one would allow writing to any queue)."""
    return {
        "x-dead-letter-exchange": spec.dead_letter_exchange,
        "x-dead-letter-routing-key": spec.dead_letter_queue,
    }


def dead_letter_queue_arguments(spec: StreamSpec, broker_major: int) -> dict[str, Any]:
    """The DLQ's arguments. A quorum DLQ on RabbitMQ 4+ has no delivery limit (-1): 4.0
    otherwise limits it to 20 give-backs and then drops the message, and each time an
    operator reads the queue (``partq dlq list``) is one. RabbitMQ 3.x has no limit without
    the argument (and drops at once with -1: measured, docs/benchmarks.md)."""
    arguments: dict[str, Any] = {"x-queue-type": spec.queue_type}
    if spec.replicas is not None:
        arguments["x-quorum-initial-group-size"] = spec.replicas
    if spec.queue_type == "quorum" and broker_major >= 4:
        arguments["x-delivery-limit"] = -1
    return arguments


def earlier_arguments(spec: StreamSpec) -> list[dict[str, Any]]:
    """The quorum queue arguments partq 0.1.0 declared: dead letters through the default
    exchange. Queue arguments cannot change once a queue exists, and such queues work as
    they are (redeclaring them needs write access to ``amq.default``), so they are
    accepted as found."""
    if spec.queue_type != "quorum":
        return []
    return [
        {
            **queue_arguments(spec),
            "x-dead-letter-exchange": "",
        }
    ]


def lacks_delivery_limit(error: pika.exceptions.ChannelClosedByBroker) -> bool:
    """A PRECONDITION_FAILED from a queue declared without the limit (partq 0.1.0's)."""
    text = error.reply_text
    return "inequivalent arg" in text and ("x-delivery-limit" in text or "x-dead-letter" in text)


def upgrade_policy_command(spec: StreamSpec) -> str:
    """The ``rabbitmqctl`` command that gives a stream's quorum queues declared without a
    delivery limit (as partq 0.1.0 declared them) the limit and the dead-lettering.

    Queue arguments cannot change after a queue exists; a policy can add them
    (``--apply-to queues``, which RabbitMQ 3.10 needs for quorum queues).
    """
    definition = json.dumps(
        {
            "delivery-limit": QUORUM_DELIVERY_LIMIT,
            "dead-letter-exchange": spec.dead_letter_exchange,
            "dead-letter-routing-key": spec.dead_letter_queue,
        },
        separators=(",", ":"),
    )
    return (
        f"rabbitmqctl set_policy --apply-to queues --priority 10 partq-{spec.scope} "
        f"'{queue_pattern(spec.scope)}' '{definition}'"
    )
