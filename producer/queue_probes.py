"""Looks at a stream's queues that change nothing: depths, counts, the queue type, the
broker's version, and the refusal of a spec that RabbitMQ has queues beyond.

Each look is a passive declare (or, for the queue type, a redeclare with equal arguments):
the broker answers a missing queue or other arguments by closing the channel, and
:func:`probe` keeps pika's warning about that close out of the log while this thread
probes. Declaring, binding and deleting are :mod:`partq.producer.topology`'s.

Threads. The functions run on the calling thread, on the blocking connection it passes
(``check_partition_queues`` opens its own); ``probe``'s flag is per thread
(``threading.local``), so a probe on one thread hides no other thread's warning.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pika
import pika.exceptions
from partq.producer.contract import MAX_PARTITIONS, QUEUE_TYPES, QueueType, StreamSpec, queue_name
from partq.producer.queue_arguments import earlier_arguments, queue_arguments
from pika.adapters.blocking_connection import BlockingChannel

from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import SpecMismatch

__all__ = [
    "QueueStats",
    "beyond_spec_message",
    "broker_major",
    "check_partition_queues",
    "detect_queue_type",
    "probe",
    "queue_stats",
    "scan_partition_queues",
]


class _Probing(threading.local):
    active = False


_probing = _Probing()


class _ProbeFilter(logging.Filter):
    """Drops pika's warning about a channel the broker closed while this thread probes
    queues: a 404 (queue missing) or 406 (other arguments) is then the answer, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not (_probing.active and message.startswith("Received remote Channel.Close"))


logging.getLogger("pika.channel").addFilter(_ProbeFilter())


@contextmanager
def probe() -> Iterator[None]:
    outer = _probing.active
    _probing.active = True
    try:
        yield
    finally:
        _probing.active = outer


def broker_major(connection: pika.BlockingConnection) -> int:
    """The broker's major version (0 when it does not say)."""
    version = connection._impl.server_properties.get("version", b"")
    text = version.decode() if isinstance(version, bytes) else str(version)
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


@dataclass(frozen=True, slots=True)
class QueueStats:
    partition: int
    queue: str
    messages: int | None  # None: the queue does not exist
    consumers: int | None


def queue_stats(
    connection: pika.BlockingConnection, spec: StreamSpec, *, beyond: bool = False
) -> list[QueueStats]:
    """Depth and consumer count of every partition queue (passive declares, no plugin needed).

    With ``beyond``, also the queues ``p(P)``, ``p(P+1)``, … that exist past the spec's
    count (see :func:`scan_partition_queues`), with ``partition >= spec.partitions``.
    """
    stats: list[QueueStats] = []
    channel: BlockingChannel | None = None
    for partition in range(spec.partitions):
        queue = spec.queue(partition)
        if channel is None or not channel.is_open:
            channel = connection.channel()
        try:
            with probe():
                ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            stats.append(QueueStats(partition, queue, None, None))
            continue
        stats.append(
            QueueStats(partition, queue, ok.method.message_count, ok.method.consumer_count)
        )
    if channel is not None and channel.is_open:
        channel.close()
    if beyond:
        stats.extend(scan_partition_queues(connection, spec.scope, spec.partitions))
    return stats


def scan_partition_queues(
    connection: pika.BlockingConnection, stream: str, start: int = 0, stop: int = MAX_PARTITIONS
) -> list[QueueStats]:
    """The partition queues of ``stream`` that exist from ``p(start)`` on, one passive declare
    each, up to the first that is missing (or ``p(stop - 1)``): partq declares them
    contiguously, so ``start=0`` counts a stream's queues and ``start=P`` finds those
    beyond a spec of ``P`` partitions (usually none: one declare)."""
    found: list[QueueStats] = []
    channel = connection.channel()
    for partition in range(start, min(stop, MAX_PARTITIONS)):
        queue = queue_name(stream, partition)
        try:
            with probe():
                ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            return found  # the 404 closed the channel
        found.append(
            QueueStats(partition, queue, ok.method.message_count, ok.method.consumer_count)
        )
    channel.close()
    return found


def beyond_spec_message(spec: StreamSpec, beyond: list[QueueStats]) -> str:
    """Why a spec of P partitions is refused when queues ``p(P)``… exist (one line)."""
    count = beyond[-1].partition + 1
    messages = sum(q.messages or 0 for q in beyond)
    return (
        f"stream {spec.name!r} has {spec.partitions} partitions in etcd, but RabbitMQ has "
        f"{count} partition queues: {beyond[0].queue}…{beyond[-1].queue} hold {messages} "
        f"messages that no one reads or writes with {spec.partitions} partitions, and keys "
        f"would hash to other partitions than before (was the spec lost and the stream "
        f"re-created with fewer partitions?): restore the spec from the queues with "
        f"`partq stream create {spec.name} --adopt`"
    )


def check_partition_queues(
    url: AmqpURL,
    spec: StreamSpec,
    *,
    name: str = "partq-check",
    resizing_to: Callable[[], int | None] | None = None,
) -> None:
    """Refuse (:class:`SpecMismatch`) a spec that RabbitMQ has queues beyond.

    One passive declare of ``p(P)``, on a short-lived connection: run once when a
    producer starts, so a stale partition count never publishes. A resized spec (epoch
    above 0) is not checked: only a resize writes one, and during a shrink the old
    queues beyond it still drain until the resize deletes them; the spec that the check
    is about, one re-created after etcd lost it, is of epoch 0 (``create``, ``--adopt``).
    ``resizing_to``: asked only when queues beyond P exist, the larger count of a resize
    that runs (None: none runs); a grow declares its queues before the switch, so queues up
    to that count are the resize's, not a lost spec's.
    """
    if spec.partitions >= MAX_PARTITIONS or spec.epoch:
        return
    with blocking_connection(url, name=name) as connection:
        beyond = scan_partition_queues(connection, spec.name, spec.partitions)
    if beyond and resizing_to is not None:
        widest = resizing_to()  # read after the scan: a resize that declared them is seen
        if widest is not None and beyond[-1].partition < widest:
            return
    if beyond:
        raise SpecMismatch(beyond_spec_message(spec, beyond))


_CURRENT_TYPE = re.compile(r"inequivalent arg 'x-queue-type'.*but current is '(\w+)'")


def detect_queue_type(connection: pika.BlockingConnection, stream: str) -> QueueType | None:
    """The queue type of ``stream``'s existing queue ``p00000``, or None if it cannot be told.

    A passive declare does not return a queue's arguments, so this redeclares the queue with
    the arguments partq gives each type: the declare that RabbitMQ accepts (as a no-op: the
    arguments are equal) names the type, and a refusal about ``x-queue-type`` names the
    current one. Nothing changes on the broker. Call it only for a queue that exists (a
    redeclare of a missing queue would create it).
    """
    queue = queue_name(stream, 0)
    for queue_type in QUEUE_TYPES:
        spec = StreamSpec(stream, 1, queue_type)
        candidates = [queue_arguments(spec), *earlier_arguments(spec)]
        if queue_type == "quorum":  # without the delivery limit (upgrade_policy_command)
            candidates.append({"x-single-active-consumer": True, "x-queue-type": "quorum"})
        for arguments in candidates:
            channel = connection.channel()
            try:
                with probe():
                    channel.queue_declare(queue, durable=True, arguments=arguments)
            except pika.exceptions.ChannelClosedByBroker as e:
                match = _CURRENT_TYPE.search(e.reply_text)
                if match and match.group(1) in QUEUE_TYPES:
                    return match.group(1)  # type: ignore[return-value]
                continue
            channel.close()
            return queue_type
    return None
