"""Stream administration: create (spec in etcd + topology in RabbitMQ), adopt, describe, list.

A stream's partition count has two witnesses: the spec in etcd and the partition queues
in RabbitMQ. ``create`` asks both, so a spec lost with etcd's data is not silently
re-created with another count (the queues beyond it would keep their messages unread,
and keys would hash elsewhere); ``adopt`` restores a lost spec from the queues.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pika
from partq.coordinator.leader.resize import State as ResizeState
from partq.coordinator.leader.resize import command_line, summary
from partq.coordinator.leader.resizer import read_record
from partq.coordinator.ops.groups import delete_queues
from partq.producer.contract import (
    MAX_PARTITIONS,
    OnFailure,
    QueueType,
    StreamSpec,
    queue_name,
    refuse_overlap,
)
from partq.producer.queue_probes import (
    QueueStats,
    beyond_spec_message,
    detect_queue_type,
    queue_stats,
    scan_partition_queues,
)
from partq.producer.registry import Registry
from partq.producer.topology import declare_stream

from partq.kernel import keys
from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import SpecMismatch, StreamNotFound, UsageError

__all__ = [
    "Description",
    "adopt_stream",
    "beyond_line",
    "create_stream",
    "delete",
    "describe",
]


def _stored(registry: Registry, stream: str) -> StreamSpec | None:
    try:
        return registry.read_spec(stream)
    except StreamNotFound:
        return None


def create_stream(registry: Registry, amqp_url: AmqpURL, spec: StreamSpec) -> bool:
    """Store the spec (create-if-absent) and declare its queues. True if newly created.

    Refused before anything is stored or declared: a stored spec that differs; partition
    queues beyond ``spec.partitions`` in RabbitMQ; partition queues with no spec in etcd
    (use :func:`adopt_stream`); a name that overlaps another stream's queues.
    """
    refuse_overlap(spec.name)
    stored = _stored(registry, spec.name)
    _refuse_while_resizing(registry, spec.name, "create")
    if stored is not None and stored.epoch and stored == replace(spec, epoch=stored.epoch):
        spec = stored  # resized: its current layout is bound, never epoch 0's again
    if stored is not None and stored != spec:
        registry.create(spec)  # raises SpecMismatch naming both values
    with blocking_connection(amqp_url) as connection:
        _check_queues(connection, spec, stored)
        created = registry.create(spec)
        declare_stream(connection, spec)
    return created


def _check_queues(
    connection: pika.BlockingConnection, spec: StreamSpec, stored: StreamSpec | None
) -> None:
    """Refuse ``spec`` when RabbitMQ's queues of the stream disagree with it.

    With the spec stored (equal to ``spec``): one passive declare of ``p(P)`` (a queue
    beyond). Without: ``p00000``, ``p(P-1)`` and ``p(P)``, and any of them existing is
    refused, counted, with ``--adopt`` as the way back.
    """
    name, partitions = spec.name, spec.partitions
    beyond = scan_partition_queues(connection, name, partitions)
    if stored is not None:
        if beyond:
            raise SpecMismatch(beyond_spec_message(spec, beyond))
        return
    found = scan_partition_queues(connection, name, 0)
    if not found and partitions > 1:
        found = scan_partition_queues(connection, name, partitions - 1, partitions)
    found += [q for q in beyond if q.partition >= len(found)]
    if not found:
        return
    count = found[-1].partition + 1
    messages = sum(q.messages or 0 for q in found)
    raise SpecMismatch(
        f"stream {name!r} has no spec in etcd, but RabbitMQ has {count} partition queues "
        f"({found[0].queue}…{found[-1].queue}, {messages} messages) and {partitions} "
        f"partitions were asked: if etcd lost the spec, restore it from the queues with "
        f"`partq stream create {name} --adopt`; if the queues and their messages are not "
        f"wanted, delete them first"
    )


def _refuse_while_resizing(registry: Registry, stream: str, verb: str) -> None:
    """A running resize owns the stream's bindings: ``create`` or ``adopt`` would bind a
    layout the resize cut (or not yet bound); refused in one line."""
    running = resize_record(registry, stream)
    if running is not None and running.running:
        target = running.resize.new.partitions
        raise UsageError(
            f"stream {stream!r} is being resized to {target} partitions "
            f"({running.phase.value}): finish that first with "
            f"`{command_line(stream, target, wait=True)}`, then {verb} again"
        )


def resize_record(registry: Registry, stream: str) -> ResizeState | None:
    """``stream``'s last resize (running or retired), or None if it was never resized."""
    return read_record(registry, stream)[0]


def adopt_stream(
    registry: Registry,
    amqp_url: AmqpURL,
    stream: str,
    *,
    partitions: int | None = None,
    queue_type: QueueType | None = None,
    on_failure: OnFailure | None = None,
    replicas: int | None = None,
) -> tuple[StreamSpec, bool]:
    """Restore ``stream``'s spec from its queues in RabbitMQ; (spec, True if newly stored).

    The count is that of the queues ``p00000``, ``p00001``, … up to the first missing (at
    most ``MAX_PARTITIONS``); the queue type is detected (:func:`detect_queue_type`) or
    ``queue_type``. ``partitions`` or ``queue_type`` given and disagreeing with the queues,
    or a stored spec that differs, is refused. The queues cannot tell ``on_failure`` or
    ``replicas``: given, they are used; otherwise a stored spec's, else parking (as
    ``create``) and the broker's default. The exchange, bindings and dead-letter queue are
    declared again (idempotent; a quorum queue's replicas are checked by the broker).
    """
    refuse_overlap(stream)
    stored = _stored(registry, stream)
    _refuse_while_resizing(registry, stream, "adopt")
    with blocking_connection(amqp_url) as connection:
        found = scan_partition_queues(connection, stream, 0, MAX_PARTITIONS)
        if not found:
            raise StreamNotFound(
                f"nothing to adopt: queue {queue_name(stream, 0)} does not exist in RabbitMQ; "
                f"create the stream with `partq stream create {stream} --partitions N`"
            )
        count = len(found)
        messages = sum(q.messages or 0 for q in found)
        if partitions is not None and partitions != count:
            raise SpecMismatch(
                f"stream {stream!r}: RabbitMQ has {count} partition queues "
                f"({found[0].queue}…{found[-1].queue}, {messages} messages), not {partitions}: "
                f"adopt with --partitions {count}, or without --partitions"
            )
        detected = detect_queue_type(connection, stream)
        if queue_type is not None and detected is not None and queue_type != detected:
            raise SpecMismatch(
                f"stream {stream!r}: queue {found[0].queue} is a {detected} queue, "
                f"not {queue_type}: adopt with --queue-type {detected}, or without --queue-type"
            )
        chosen = queue_type or detected
        if chosen is None:
            raise UsageError(
                f"cannot tell the queue type of {found[0].queue} (its arguments are not "
                f"partq's): give --queue-type quorum or --queue-type classic"
            )
        if stored is not None:
            on_failure = on_failure or stored.on_failure
            replicas = replicas if replicas is not None else stored.replicas
        spec = StreamSpec(
            stream,
            count,
            chosen,
            on_failure=on_failure or "park",
            replicas=replicas,
            epoch=stored.epoch if stored is not None else 0,  # a lost spec: the contract's
        )
        for flag, kept, asked in (
            ("--on-failure", stored and stored.on_failure, spec.on_failure),
            ("--replicas", stored and stored.replicas, spec.replicas),
        ):
            if stored is not None and kept != asked:
                raise SpecMismatch(
                    f"stream {stream!r} is stored with {flag} {kept}, not {asked}: a stream "
                    f"keeps the settings it was created with; adopt without {flag}"
                )
        if stored is not None and stored != spec:
            raise SpecMismatch(
                f"stream {stream!r} has {stored.partitions} partitions ({stored.queue_type}) "
                f"in etcd, but RabbitMQ has {count} partition queues ({chosen}, {messages} "
                f"messages): if the queues are right, stop the stream's producers, consumers "
                f"and coordinators (they hold the old count), delete the stale spec with "
                f"`etcdctl del {keys.spec(stream)}` and adopt again"
            )
        created = registry.create(spec)
        declare_stream(connection, spec)
    return spec, created


@dataclass(frozen=True)
class Description:
    spec: StreamSpec
    queues: list[QueueStats]
    beyond: list[QueueStats]  # partition queues that exist past spec.partitions
    resize: ResizeState | None = None  # the stream's last resize, if it was ever resized

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.spec.name,
            "partitions": self.spec.partitions,
            "queue_type": self.spec.queue_type,
            "replicas": self.spec.replicas,
            "on_failure": self.spec.on_failure,
            "exchange": self.spec.exchange,
            "dead_letter_queue": self.spec.dead_letter_queue,
            "queues": [_queue_dict(q) for q in self.queues],
            "beyond_spec": [_queue_dict(q) for q in self.beyond],
            "epoch": self.spec.epoch,
            "resize": summary(self.resize) if self.resize is not None else None,
        }


def _queue_dict(q: QueueStats) -> dict[str, object]:
    return {
        "partition": q.partition,
        "queue": q.queue,
        "messages": q.messages,
        "consumers": q.consumers,
    }


def beyond_line(queue: str, partitions: int, messages: int | None) -> str:
    """How describe, status and the status page name a queue beyond the spec's count."""
    return f"queue {queue} exists beyond the stream's {partitions} partitions: {messages} messages"


def describe(registry: Registry, amqp_url: AmqpURL, stream: str) -> Description:
    spec = registry.read_spec(stream)
    with blocking_connection(amqp_url) as connection:
        stats = queue_stats(connection, spec, beyond=True)
    within = [q for q in stats if q.partition < spec.partitions]
    beyond = [q for q in stats if q.partition >= spec.partitions]
    return Description(spec, within, beyond, resize_record(registry, stream))


def delete(registry: Registry, amqp_url: AmqpURL, stream: str) -> None:
    """Delete the stream's queues (and their messages), every group's, and every etcd key
    of it; during a resize, the queues of both layouts."""
    spec = registry.read_spec(stream)
    groups = [spec.in_group(g) for g in registry.list_groups(stream)]
    with blocking_connection(amqp_url) as connection:  # the default group's last
        delete_queues(registry, connection, [*groups, spec], exchange=True)
    registry.delete(stream)
