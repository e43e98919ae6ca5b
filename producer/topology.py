"""A stream's RabbitMQ topology, changed: declaring its exchanges and queues, binding a
layout, a resize's fences, deleting.

The queues' arguments are :mod:`partq.producer.queue_arguments`'s; looks that change nothing
(depths, counts, the queue type) are :mod:`partq.producer.queue_probes`'. Connections come
from :mod:`partq.kernel.amqp`.

Threads. The functions run on the calling thread, on the blocking connection it passes (a
pika ``BlockingConnection`` belongs to one thread); they keep no state.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence

import pika
import pika.exceptions
from partq.producer.contract import (
    CONTROL_FENCE,
    DEFAULT_GROUP,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_PARTITION,
    HEADER_SEAL,
    StreamSpec,
    fence_routing_key,
    partition_exchange,
    queue_name,
)
from partq.producer.layout import Layout
from partq.producer.queue_arguments import (
    dead_letter_queue_arguments,
    earlier_arguments,
    lacks_delivery_limit,
    queue_arguments,
    upgrade_policy_command,
)
from partq.producer.queue_probes import broker_major, probe
from pika.adapters.blocking_connection import BlockingChannel

from partq.kernel.errors import UsageError

__all__ = [
    "bind_layout",
    "declare_partition_queues",
    "declare_stream",
    "delete_if_empty",
    "delete_partition_exchange",
    "delete_stream",
    "is_routed",
    "publish_fence",
    "route_through_partition_exchanges",
    "unbind_fillers",
    "unbind_layout",
]

log = logging.getLogger("partq.amqp")


def declare_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    """Declare the exchange, the P single-active-consumer queues, the dead-letter queue and
    exchange and the parking exchange (consumers bind parking queues to it), each partition
    bound under the spec's epoch (``partq.producer.layout``), and to the dead-letter
    exchange under its name (for drains' fillers).

    Idempotent. A queue that exists with other arguments is reported, not replaced.
    """
    channel = connection.channel()
    channel.exchange_declare(spec.exchange, exchange_type="direct", durable=True)
    channel = _declare_dead_letter_queue(connection, channel, spec)
    channel.exchange_declare(spec.dead_letter_exchange, exchange_type="direct", durable=True)
    channel.exchange_declare(spec.park_exchange, exchange_type="direct", durable=True)
    channel.queue_bind(
        spec.dead_letter_queue, spec.dead_letter_exchange, routing_key=spec.dead_letter_queue
    )
    channel, legacy = _declare_partitions(connection, channel, spec, range(spec.partitions))
    _bind_fillers(channel, spec, range(spec.partitions))
    routed = is_routed(connection, spec)
    if routed:
        _route(channel, spec, range(spec.partitions))
    for partition in range(spec.partitions):
        # the current epoch's routing key: "q" as created, "E.q" once resized (an older
        # epoch's binding is never made again: its late publishes must stay unroutable)
        _bind_partition(channel, [spec], partition, spec.layout.routing_key(partition), routed)
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
        queue = queue_name(spec.scope, partition)
        try:
            channel = _declare_partition_queue(connection, channel, queue, spec)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 403:  # ACCESS_REFUSED: the caller names the missing right
                raise
            if not lacks_delivery_limit(e):
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
    if is_routed(connection, spec):
        _route(channel, spec, partitions)
    channel.close()


def is_routed(connection: pika.BlockingConnection, spec: StreamSpec) -> bool:
    """Whether the stream routes through partition exchanges (it has had groups:
    :func:`partq.producer.contract.partition_exchange`): partition 0's exchange exists."""
    channel = connection.channel()
    try:
        with probe():
            channel.exchange_declare(partition_exchange(spec.name, 0), passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    channel.close()
    return True


def _route(channel: BlockingChannel, spec: StreamSpec, partitions: Iterable[int]) -> None:
    """Declare the exchanges of ``partitions`` and bind ``spec``'s group's queues to them."""
    for partition in partitions:
        exchange = partition_exchange(spec.name, partition)
        channel.exchange_declare(exchange, exchange_type="fanout", durable=True)
        channel.queue_bind(queue_name(spec.scope, partition), exchange)


def route_through_partition_exchanges(
    connection: pika.BlockingConnection, spec: StreamSpec
) -> None:
    """Move the stream's bindings onto partition exchanges (its first group's creation), for
    the current layout: each partition's exchange declared, the default group's queue bound
    to it, the stream's exchange bound to it under the partition's routing key, and only
    then the queue's own binding removed. No publish is unroutable or delivered twice in
    between (RabbitMQ puts a message in a queue once, however many bindings lead there).
    Idempotent."""
    default = spec.in_group(DEFAULT_GROUP)
    channel = connection.channel()
    _route(channel, default, range(spec.partitions))
    for partition in range(spec.partitions):
        routing_key = spec.layout.routing_key(partition)
        _bind_partition(channel, [default], partition, routing_key, routed=True)
        _bind_partition(channel, [default], partition, routing_key, routed=False, bind=False)
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
        queue = queue_name(spec.scope, partition)
        if bind:
            channel.queue_bind(queue, spec.dead_letter_exchange, routing_key=queue)
        else:
            channel.queue_unbind(queue, spec.dead_letter_exchange, routing_key=queue)


def _bind_partition(
    channel: BlockingChannel,
    specs: Sequence[StreamSpec],
    partition: int,
    routing_key: str,
    routed: bool,
    *,
    bind: bool = True,
) -> None:
    """Make (``bind``) or remove the binding that carries ``routing_key`` of the stream's
    exchange to ``partition``: to its partition exchange, one for every group, when the
    stream is ``routed`` (:func:`is_routed`); else to the queue of each group of ``specs``."""
    exchange = specs[0].exchange
    if routed:
        change = channel.exchange_bind if bind else channel.exchange_unbind
        change(partition_exchange(specs[0].name, partition), exchange, routing_key=routing_key)
        return
    for spec in specs:
        change = channel.queue_bind if bind else channel.queue_unbind
        change(queue_name(spec.scope, partition), exchange, routing_key=routing_key)


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
    connection: pika.BlockingConnection,
    specs: Sequence[StreamSpec],
    layout: Layout,
    *,
    bind: bool = True,
) -> None:
    """Bind (or with ``bind=False`` unbind) every partition of ``layout`` to the stream's
    exchange under the layout's routing keys: its partition exchange, one binding for every
    group, on a stream that has groups; else the queue of each group of ``specs``.
    Idempotent both ways: RabbitMQ ignores a binding made twice, and the removal of one
    that is not there."""
    routed = is_routed(connection, specs[0])
    channel = connection.channel()
    for partition in range(layout.partitions):
        _bind_partition(channel, specs, partition, layout.routing_key(partition), routed, bind=bind)
    channel.close()


def unbind_layout(
    connection: pika.BlockingConnection, specs: Sequence[StreamSpec], layout: Layout
) -> None:
    """Remove every binding of ``layout``'s epoch (a resize's cut)."""
    bind_layout(connection, specs, layout, bind=False)


def publish_fence(
    connection: pika.BlockingConnection,
    specs: Sequence[StreamSpec],
    epoch: int,
    partition: int,
    sender: str,
    seal: str,
) -> None:
    """Publish, confirmed, the fence that ends ``epoch`` in ``partition``'s queue: through
    the stream's exchange on ``fence.E.q``, bound only for the moment (bind, publish,
    unbind; each idempotent), with partq's control header, the epoch and ``seal`` (what
    the drained record of whoever handles it must carry). ``sender`` is the user the
    connection logged in as (the message's ``user_id``, which RabbitMQ checks, so a
    consumer can tell a fence from a forged one). ``specs``: the stream's spec for each of
    its groups: one publish puts the fence into each group's queue of ``partition``."""
    routing_key, exchange = fence_routing_key(epoch, partition), specs[0].exchange
    routed = is_routed(connection, specs[0])
    channel = connection.channel()
    channel.confirm_delivery()
    _bind_partition(channel, specs, partition, routing_key, routed)
    properties = pika.BasicProperties(
        delivery_mode=2,
        message_id=f"partq-fence-{epoch}-{partition}-{uuid.uuid4().hex}",
        headers={
            HEADER_CONTROL: CONTROL_FENCE,
            HEADER_EPOCH: epoch,
            HEADER_PARTITION: partition,
            HEADER_SEAL: seal,
        },
        app_id="partq",
        user_id=sender,
        timestamp=int(time.time()),
    )
    channel.basic_publish(exchange, routing_key, b"", properties, mandatory=True)
    _bind_partition(channel, specs, partition, routing_key, routed, bind=False)
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
    queue = queue_name(spec.scope, partition)
    channel = connection.channel()
    try:
        with probe():
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
        with probe():
            channel.queue_delete(queue, if_empty=classic, if_unused=classic)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 406:  # PRECONDITION_FAILED: a message or a consumer came
            return 1
        raise
    channel.close()
    return None


def delete_partition_exchange(
    connection: pika.BlockingConnection, spec: StreamSpec, partition: int
) -> None:
    """Delete a retired partition's exchange (a shrink of a stream that has groups, once
    every group's queue of it is gone). Idempotent."""
    channel = connection.channel()
    channel.exchange_delete(partition_exchange(spec.name, partition))
    channel.close()


def _declare_dead_letter_queue(
    connection: pika.BlockingConnection, channel: BlockingChannel, spec: StreamSpec
) -> BlockingChannel:
    """Declare the DLQ; one made before it got its arguments is kept, with a warning."""
    arguments = dead_letter_queue_arguments(spec, broker_major(connection))
    try:
        with probe():
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
        with probe():
            channel.queue_declare(queue, durable=True, arguments=queue_arguments(spec))
        return channel
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code != 406 or "x-dead-letter-exchange" not in e.reply_text:
            raise
        first = e
    for arguments in earlier_arguments(spec):
        channel = connection.channel()
        try:
            with probe():
                channel.queue_declare(queue, durable=True, arguments=arguments)
            return channel
        except pika.exceptions.ChannelClosedByBroker:
            continue
    raise first


def delete_stream(
    connection: pika.BlockingConnection, spec: StreamSpec, *, exchange: bool = True
) -> None:
    """Delete the queues and exchanges of ``spec``'s group, and the stream's exchange with
    ``exchange`` (not for one group of several: the others are bound to it)."""
    routed = exchange and is_routed(connection, spec)
    channel = connection.channel()
    for partition in range(spec.partitions):
        channel.queue_delete(spec.queue(partition))
        if routed:
            channel.exchange_delete(partition_exchange(spec.name, partition))
    channel.queue_delete(spec.dead_letter_queue)
    if exchange:
        channel.exchange_delete(spec.exchange)
    channel.exchange_delete(spec.dead_letter_exchange)
    channel.exchange_delete(spec.park_exchange)
    channel.close()
