"""Stream administration: create (spec in etcd + topology in RabbitMQ), describe, list."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.streams import Registry
from producer.amqp import (
    QueueStats,
    blocking_connection,
    declare_stream,
    delete_stream,
    queue_stats,
)
from producer.contract import StreamSpec
from producer.errors import StreamNotFound

__all__ = ["Description", "create_stream", "delete", "describe"]


def create_stream(registry: Registry, amqp_url: str, spec: StreamSpec) -> bool:
    """Store the spec (create-if-absent) and declare its queues. True if newly created.

    A stored spec that differs is refused before anything is declared.
    """
    try:
        stored: StreamSpec | None = registry.read_spec(spec.name)
    except StreamNotFound:
        stored = None
    if stored is not None and stored != spec:
        registry.create(spec)  # raises SpecMismatch naming both values
    with blocking_connection(amqp_url) as connection:
        created = registry.create(spec)
        declare_stream(connection, spec)
    return created


@dataclass(frozen=True)
class Description:
    spec: StreamSpec
    queues: list[QueueStats]

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.spec.name,
            "partitions": self.spec.partitions,
            "queue_type": self.spec.queue_type,
            "exchange": self.spec.exchange,
            "dead_letter_queue": self.spec.dead_letter_queue,
            "queues": [
                {
                    "partition": q.partition,
                    "queue": q.queue,
                    "messages": q.messages,
                    "consumers": q.consumers,
                }
                for q in self.queues
            ],
        }


def describe(registry: Registry, amqp_url: str, stream: str) -> Description:
    spec = registry.read_spec(stream)
    with blocking_connection(amqp_url) as connection:
        return Description(spec, queue_stats(connection, spec))


def delete(registry: Registry, amqp_url: str, stream: str) -> None:
    """Delete the stream's queues (and their messages) and every etcd key of it."""
    spec = registry.read_spec(stream)
    with blocking_connection(amqp_url) as connection:
        delete_stream(connection, spec)
    registry.delete(stream)
