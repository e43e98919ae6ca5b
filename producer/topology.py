"""A stream's RabbitMQ topology: its queues' arguments, declaring, deleting, probing, depths.

Connections come from :mod:`partq.kernel.amqp`.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from partq.producer.contract import (
    CONTROL_FENCE,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_KEY,
    HEADER_KEY_B64,
    HEADER_PARTITION,
    HEADER_PUBLISHED_MS,
    MAX_PARTITIONS,
    QUEUE_TYPES,
    QUORUM_DELIVERY_LIMIT,
    QueueType,
    StreamSpec,
    encode_key,
    fence_routing_key,
    queue_name,
    queue_pattern,
)
from partq.producer.layout import Layout
from pika.adapters.blocking_connection import BlockingChannel

from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import SpecMismatch, UsageError

__all__ = [
    "QueueStats",
    "beyond_spec_message",
    "bind_layout",
    "check_partition_queues",
    "dead_letter_arguments",
    "declare_partition_queues",
    "declare_stream",
    "delete_if_empty",
    "delete_stream",
    "detect_queue_type",
    "message_properties",
    "park_queue_arguments",
    "publish_fence",
    "queue_arguments",
    "queue_stats",
    "scan_partition_queues",
    "unbind_fillers",
    "unbind_layout",
    "upgrade_policy_command",
]

log = logging.getLogger("partq.amqp")


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
def _probe() -> Iterator[None]:
    outer = _probing.active
    _probing.active = True
    try:
        yield
    finally:
        _probing.active = outer


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


def _earlier_arguments(spec: StreamSpec) -> list[dict[str, Any]]:
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
        f"rabbitmqctl set_policy --apply-to queues --priority 10 partq-{spec.name} "
        f"'{queue_pattern(spec.name)}' '{definition}'"
    )


def _lacks_delivery_limit(error: pika.exceptions.ChannelClosedByBroker) -> bool:
    """A PRECONDITION_FAILED from a queue declared without the limit (partq 0.1.0's)."""
    text = error.reply_text
    return "inequivalent arg" in text and ("x-delivery-limit" in text or "x-dead-letter" in text)


def declare_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    """Declare the exchange, the P single-active-consumer queues and the dead-letter queue,
    each partition bound under the spec's epoch (``partq.producer.layout``), and to the
    dead-letter exchange under its name (for drains' fillers).

    Idempotent. A queue that exists with other arguments is reported, not replaced.
    """
    channel = connection.channel()
    channel.exchange_declare(spec.exchange, exchange_type="direct", durable=True)
    channel = _declare_dead_letter_queue(connection, channel, spec)
    channel.exchange_declare(spec.dead_letter_exchange, exchange_type="direct", durable=True)
    channel.queue_bind(
        spec.dead_letter_queue, spec.dead_letter_exchange, routing_key=spec.dead_letter_queue
    )
    channel, legacy = _declare_partitions(connection, channel, spec, range(spec.partitions))
    _bind_fillers(channel, spec, range(spec.partitions))
    for partition in range(spec.partitions):
        # the current epoch's routing key: "q" as created, "E.q" once resized (an older
        # epoch's binding is never made again: its late publishes must stay unroutable)
        channel.queue_bind(
            spec.queue(partition), spec.exchange, routing_key=spec.layout.routing_key(partition)
        )
    if legacy:
        log.warning(
            "%d queues of stream %s have no delivery limit (declared by partq 0.1.0): a "
            "quorum queue then returns messages to its back, which can reorder a key during "
            "a handoff. Upgrade them with: %s",
            len(legacy),
            spec.name,
            upgrade_policy_command(spec),
        )
    channel.close()


def _declare_partitions(
    connection: pika.BlockingConnection,
    channel: BlockingChannel,
    spec: StreamSpec,
    partitions: Iterable[int],
) -> tuple[BlockingChannel, list[str]]:
    """Declare the queues of ``partitions`` (not bound): the channel to go on with and the
    queues found as partq 0.1.0 declared them (without the delivery limit)."""
    legacy: list[str] = []
    for partition in partitions:
        queue = queue_name(spec.name, partition)
        try:
            channel = _declare_partition_queue(connection, channel, queue, spec)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 403:  # ACCESS_REFUSED: the caller names the missing right
                raise
            if not _lacks_delivery_limit(e):
                raise UsageError(
                    f"queue {queue} already exists with other settings ({e.reply_text}): "
                    f"delete it or use another stream name"
                ) from None
            legacy.append(queue)  # without the limit: it stays, the policy upgrades it
            channel = connection.channel()
            channel.queue_declare(queue, passive=True)
    return channel, legacy


def declare_partition_queues(
    connection: pika.BlockingConnection, spec: StreamSpec, partitions: Iterable[int]
) -> None:
    """Declare these partition queues of ``spec``'s stream with its arguments and no
    binding (a resize's added queues: nothing reaches them before the new epoch is bound).
    Idempotent; ``partitions`` may lie beyond ``spec.partitions``."""
    partitions = list(partitions)
    channel, _legacy = _declare_partitions(connection, connection.channel(), spec, partitions)
    _bind_fillers(channel, spec, partitions)
    channel.close()


def _bind_fillers(
    channel: BlockingChannel, spec: StreamSpec, partitions: Iterable[int], *, bind: bool = True
) -> None:
    """Bind (or with ``bind=False`` unbind) each partition queue to the stream's dead-letter
    exchange under its own name: the way a draining consumer's fillers reach it
    (``partq.consumers.broker.fillers``). Dead letters go under the dead-letter queue's name, so
    none
    reaches a partition this way. Idempotent both ways."""
    for partition in partitions:
        queue = queue_name(spec.name, partition)
        if bind:
            channel.queue_bind(queue, spec.dead_letter_exchange, routing_key=queue)
        else:
            channel.queue_unbind(queue, spec.dead_letter_exchange, routing_key=queue)


def unbind_fillers(
    connection: pika.BlockingConnection, spec: StreamSpec, partitions: Iterable[int]
) -> None:
    """Unbind these partition queues from the dead-letter exchange (a shrink's retired
    queues, at its cut: then nothing can land in them but the fence, and an empty one
    stays empty for :func:`delete_if_empty`)."""
    channel = connection.channel()
    _bind_fillers(channel, spec, partitions, bind=False)
    channel.close()


def bind_layout(
    connection: pika.BlockingConnection, spec: StreamSpec, layout: Layout, *, bind: bool = True
) -> None:
    """Bind (or with ``bind=False`` unbind) every partition queue of ``layout`` to the
    stream's exchange under the layout's routing keys. Idempotent both ways: RabbitMQ
    ignores a binding made twice, and the removal of one that is not there."""
    channel = connection.channel()
    for partition in range(layout.partitions):
        queue, routing_key = queue_name(spec.name, partition), layout.routing_key(partition)
        if bind:
            channel.queue_bind(queue, spec.exchange, routing_key=routing_key)
        else:
            channel.queue_unbind(queue, spec.exchange, routing_key=routing_key)
    channel.close()


def unbind_layout(connection: pika.BlockingConnection, spec: StreamSpec, layout: Layout) -> None:
    """Remove every binding of ``layout``'s epoch (a resize's cut)."""
    bind_layout(connection, spec, layout, bind=False)


def publish_fence(
    connection: pika.BlockingConnection, spec: StreamSpec, epoch: int, partition: int, sender: str
) -> None:
    """Publish, confirmed, the fence that ends ``epoch`` in ``partition``'s queue: through
    the stream's exchange on ``fence.E.q``, bound only for the moment (bind, publish,
    unbind; each idempotent), with partq's control header and the epoch. ``sender`` is
    the user the connection logged in as (the message's ``user_id``, which RabbitMQ
    checks, so a consumer can tell a fence from a forged one)."""
    queue, routing_key = queue_name(spec.name, partition), fence_routing_key(epoch, partition)
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_bind(queue, spec.exchange, routing_key=routing_key)
    properties = pika.BasicProperties(
        delivery_mode=2,
        message_id=f"partq-fence-{epoch}-{partition}-{uuid.uuid4().hex}",
        headers={HEADER_CONTROL: CONTROL_FENCE, HEADER_EPOCH: epoch, HEADER_PARTITION: partition},
        app_id="partq",
        user_id=sender,
        timestamp=int(time.time()),
    )
    channel.basic_publish(spec.exchange, routing_key, b"", properties, mandatory=True)
    channel.queue_unbind(queue, spec.exchange, routing_key=routing_key)
    channel.close()


def delete_if_empty(
    connection: pika.BlockingConnection, spec: StreamSpec, partition: int
) -> int | None:
    """Delete ``partition``'s queue if it holds no message and has no consumer: None when it
    is gone (deleted now, or before), else the messages (ready, or held by a consumer
    that is still subscribed: counted as 1 at least) that keep it. A quorum queue does
    not support ``if-empty`` (RabbitMQ closes the connection, 540), so it is counted by a
    passive declare and deleted only at 0 messages and 0 consumers; that is safe only for
    a queue no binding can fill (a resize's retired queue, after its cut). A classic
    queue is deleted with ``if-empty`` and ``if-unused`` too."""
    queue = queue_name(spec.name, partition)
    channel = connection.channel()
    try:
        with _probe():
            ok = channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return None
        raise
    messages, consumers = int(ok.method.message_count), int(ok.method.consumer_count)
    if messages or consumers:
        channel.close()
        return max(messages, 1)
    classic = spec.queue_type == "classic"
    try:
        with _probe():
            channel.queue_delete(queue, if_empty=classic, if_unused=classic)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 406:  # PRECONDITION_FAILED: a message or a consumer came
            return 1
        raise
    channel.close()
    return None


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


def broker_major(connection: pika.BlockingConnection) -> int:
    """The broker's major version (0 when it does not say)."""
    version = connection._impl.server_properties.get("version", b"")
    text = version.decode() if isinstance(version, bytes) else str(version)
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _declare_dead_letter_queue(
    connection: pika.BlockingConnection, channel: BlockingChannel, spec: StreamSpec
) -> BlockingChannel:
    """Declare the DLQ; one made before it got its arguments is kept, with a warning."""
    arguments = dead_letter_queue_arguments(spec, broker_major(connection))
    try:
        with _probe():
            channel.queue_declare(spec.dead_letter_queue, durable=True, arguments=arguments)
        return channel
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code != 406 or "x-delivery-limit" not in e.reply_text:
            raise
    channel = connection.channel()
    channel.queue_declare(spec.dead_letter_queue, passive=True)
    log.warning(
        "dead-letter queue %s has RabbitMQ 4's default delivery limit (20): every `partq dlq "
        "list` or `show` counts as a delivery and a dead letter read 20 times is dropped. "
        "Redrive or purge its dead letters, delete the queue, and run `partq stream create "
        "%s` again to recreate it without a limit",
        spec.dead_letter_queue,
        spec.name,
    )
    return channel


def _declare_partition_queue(
    connection: pika.BlockingConnection,
    channel: BlockingChannel,
    queue: str,
    spec: StreamSpec,
) -> BlockingChannel:
    """Declare ``queue`` with partq's arguments, or accept it as partq 0.1.0 declared it;
    the channel to go on with (a refused declare closes the one it was made on)."""
    try:
        with _probe():
            channel.queue_declare(queue, durable=True, arguments=queue_arguments(spec))
        return channel
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code != 406 or "x-dead-letter-exchange" not in e.reply_text:
            raise
        first = e
    for arguments in _earlier_arguments(spec):
        channel = connection.channel()
        try:
            with _probe():
                channel.queue_declare(queue, durable=True, arguments=arguments)
            return channel
        except pika.exceptions.ChannelClosedByBroker:
            continue
    raise first


def delete_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    channel = connection.channel()
    for partition in range(spec.partitions):
        channel.queue_delete(spec.queue(partition))
    channel.queue_delete(spec.dead_letter_queue)
    channel.exchange_delete(spec.exchange)
    channel.exchange_delete(spec.dead_letter_exchange)
    channel.close()


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
            with _probe():
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
        stats.extend(scan_partition_queues(connection, spec.name, spec.partitions))
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
            with _probe():
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
        candidates = [queue_arguments(spec), *_earlier_arguments(spec)]
        if queue_type == "quorum":  # without the delivery limit (upgrade_policy_command)
            candidates.append({"x-single-active-consumer": True, "x-queue-type": "quorum"})
        for arguments in candidates:
            channel = connection.channel()
            try:
                with _probe():
                    channel.queue_declare(queue, durable=True, arguments=arguments)
            except pika.exceptions.ChannelClosedByBroker as e:
                match = _CURRENT_TYPE.search(e.reply_text)
                if match and match.group(1) in QUEUE_TYPES:
                    return match.group(1)  # type: ignore[return-value]
                continue
            channel.close()
            return queue_type
    return None


_FLAGS = struct.pack(
    ">H",
    pika.BasicProperties.FLAG_HEADERS
    | pika.BasicProperties.FLAG_DELIVERY_MODE
    | pika.BasicProperties.FLAG_MESSAGE_ID
    | pika.BasicProperties.FLAG_TIMESTAMP
    | pika.BasicProperties.FLAG_APP_ID,
)
_KEY = bytes([len(HEADER_KEY)]) + HEADER_KEY.encode() + b"S"
_KEY_B64 = bytes([len(HEADER_KEY_B64)]) + HEADER_KEY_B64.encode() + b"S"
_PARTITION = bytes([len(HEADER_PARTITION)]) + HEADER_PARTITION.encode()
_PUBLISHED = bytes([len(HEADER_PUBLISHED_MS)]) + HEADER_PUBLISHED_MS.encode()
_APP_ID = b"\x05partq"
_DELIVERY_MODE = b"\x02"  # persistent
_INT32 = struct.Struct(">ci")  # pika's table int: 'I' if it fits 32 bits, else 'l'
_INT64 = struct.Struct(">cq")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def _table_int(value: int) -> bytes:
    return _INT32.pack(b"I", value) if -(2**31) <= value < 2**31 else _INT64.pack(b"l", value)


# partq's own header names: the fast encoder leaves them to pika's path (for the control
# header, to the producer's refusal there: ``Producer._prepare``)
_RESERVED = frozenset(
    (HEADER_KEY, HEADER_KEY_B64, HEADER_PARTITION, HEADER_PUBLISHED_MS, HEADER_CONTROL)
)
_LONG_STRING = struct.Struct(">cI")
_BOOL = {True: b"t\x01", False: b"t\x00"}


def _table_entries(headers: Mapping[str, Any]) -> list[bytes] | None:
    """``headers`` as pika encodes a table's entries, for names that are short strings
    (not partq's own) and values that are str, bytes, bool or 64-bit int; else None."""
    pieces: list[bytes] = []
    for name, value in headers.items():
        if type(name) is not str or name in _RESERVED:
            return None
        encoded_name = name.encode()
        if len(encoded_name) > 255:
            return None
        pieces.append(bytes((len(encoded_name),)))
        pieces.append(encoded_name)
        kind = type(value)
        if kind is str:
            data = value.encode()
            pieces.append(_LONG_STRING.pack(b"S", len(data)))
            pieces.append(data)
        elif kind is bytes:
            pieces.append(_LONG_STRING.pack(b"x", len(value)))
            pieces.append(value)
        elif kind is bool:
            pieces.append(_BOOL[value])
        elif kind is int and -(2**63) <= value < 2**63:
            pieces.append(_table_int(value))
        else:
            return None
    return pieces


def encoded_properties(
    key: str | bytes,
    partition: int,
    message_id: str,
    now: float,
    headers: Mapping[str, Any] | None = None,
) -> bytes | None:
    """The bytes pika encodes for ``message_properties(key, partition,
    message_id=message_id, headers=headers, now=now)``, built directly: the SDK's hot
    path. None where only pika's own encoder gives the exact answer (then use it):
    an empty message id (pika's path makes one up) or one over 255 bytes, a key that is
    not valid text, a partition outside a 32-bit int, a header named as partq's own or
    whose value is not a str, bytes, bool or 64-bit int (exactly those types: a
    subclass may encode otherwise). ``tests/unit/test_contract.py`` pins the equality."""
    try:
        mid = message_id.encode()
        value = key.encode() if isinstance(key, str) else base64.b64encode(key)
        extra = _table_entries(headers) if headers else []
    except (UnicodeEncodeError, TypeError, AttributeError):
        return None
    if extra is None:
        return None
    if not mid or len(mid) > 255 or not 0 <= now < 2**63 / 1000 or not 0 <= partition < 2**63:
        return None
    table = b"".join(
        (
            *extra,
            _KEY if isinstance(key, str) else _KEY_B64,
            _U32.pack(len(value)),
            value,
            _PARTITION,
            _table_int(partition),
            _PUBLISHED,
            _table_int(int(now * 1000)),
        )
    )
    return b"".join(
        (
            _FLAGS,
            _U32.pack(len(table)),
            table,
            _DELIVERY_MODE,
            bytes([len(mid)]),
            mid,
            _U64.pack(int(now)),
            _APP_ID,
        )
    )


def message_properties(
    key: str | bytes,
    partition: int,
    *,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> pika.BasicProperties:
    """Persistent message properties carrying key, partition, message id and timestamp."""
    stamp = time.time() if now is None else now
    merged: dict[str, Any] = dict(headers or {})
    merged.update(encode_key(key))
    merged[HEADER_PARTITION] = partition
    merged[HEADER_PUBLISHED_MS] = int(stamp * 1000)
    return pika.BasicProperties(
        delivery_mode=2,
        message_id=message_id or uuid.uuid4().hex,
        timestamp=int(stamp),
        headers=merged,
        app_id="partq",
    )
