"""RabbitMQ edge: URLs, connections, a stream's topology and its queue statistics.

pika's errors are translated here into :mod:`producer.errors`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from producer.contract import (
    HEADER_PARTITION,
    HEADER_PUBLISHED_MS,
    QUORUM_DELIVERY_LIMIT,
    StreamSpec,
    encode_key,
    queue_pattern,
)
from producer.errors import BrokerUnavailable, UsageError

__all__ = [
    "DEFAULT_AMQP_URL",
    "QueueStats",
    "blocking_connection",
    "connection_parameters",
    "dead_letter_arguments",
    "declare_stream",
    "delete_stream",
    "message_properties",
    "queue_stats",
    "redact_url",
    "upgrade_policy_command",
]

log = logging.getLogger("partq.amqp")
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def connection_parameters(
    url: str, *, name: str, heartbeat: int | None = None
) -> pika.URLParameters:
    if not url.startswith(("amqp://", "amqps://")):
        raise UsageError(
            f"AMQP URL {redact_url(url)!r} must start with amqp:// or amqps://, "
            f"e.g. {DEFAULT_AMQP_URL!r}"
        )
    try:
        params = pika.URLParameters(url)
    except Exception as e:  # pika raises ValueError and friends for bad query strings
        raise UsageError(f"bad AMQP URL {redact_url(url)!r}: {e}") from None
    params.client_properties = {"connection_name": name, "product": "partq"}
    if heartbeat is not None:
        params.heartbeat = heartbeat
    params.blocked_connection_timeout = 60
    return params


def unavailable(url: str, error: BaseException) -> BrokerUnavailable:
    detail = str(error) or type(error).__name__
    if isinstance(error, pika.exceptions.ProbableAuthenticationError):
        hint = "check the user and password"
    elif isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        hint = "check the user's permissions on the virtual host"
    else:
        hint = "is it running? (set PARTQ_AMQP_URL or --amqp-url)"
    return BrokerUnavailable(f"cannot reach RabbitMQ at {redact_url(url)}: {hint} ({detail})")


@contextmanager
def blocking_connection(
    url: str, *, name: str = "partq-admin"
) -> Iterator[pika.BlockingConnection]:
    params = connection_parameters(url, name=name)
    params.connection_attempts = 1
    params.socket_timeout = 5
    try:
        connection = pika.BlockingConnection(params)
    except pika.exceptions.AMQPError as e:
        raise unavailable(url, e) from None
    try:
        yield connection
    finally:
        if connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()


def _queue_arguments(spec: StreamSpec) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-single-active-consumer": True, "x-queue-type": spec.queue_type}
    if spec.queue_type == "quorum":  # see QUORUM_DELIVERY_LIMIT: returns to the head, never dropped
        arguments.update(dead_letter_arguments(spec))
        arguments["x-delivery-limit"] = QUORUM_DELIVERY_LIMIT
    return arguments


def dead_letter_arguments(spec: StreamSpec) -> dict[str, Any]:
    return {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": spec.dead_letter_queue}


def upgrade_policy_command(spec: StreamSpec) -> str:
    """The ``rabbitmqctl`` command that gives a stream created before partq 0.2 its delivery limit.

    Queue arguments cannot change after a queue exists; a policy can add the limit and the
    dead-lettering (``--apply-to queues``, which RabbitMQ 3.10 needs for quorum queues).
    """
    definition = json.dumps(
        {
            "delivery-limit": QUORUM_DELIVERY_LIMIT,
            "dead-letter-exchange": "",
            "dead-letter-routing-key": spec.dead_letter_queue,
        },
        separators=(",", ":"),
    )
    return (
        f"rabbitmqctl set_policy --apply-to queues --priority 10 partq-{spec.name} "
        f"'{queue_pattern(spec.name)}' '{definition}'"
    )


def _lacks_delivery_limit(error: pika.exceptions.ChannelClosedByBroker) -> bool:
    """A PRECONDITION_FAILED from a queue an older partq declared without the limit."""
    text = error.reply_text
    return "inequivalent arg" in text and ("x-delivery-limit" in text or "x-dead-letter" in text)


def declare_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    """Declare the exchange, the P single-active-consumer queues and the dead-letter queue.

    Idempotent. A queue that exists with other arguments is reported, not replaced.
    """
    channel = connection.channel()
    channel.exchange_declare(spec.exchange, exchange_type="direct", durable=True)
    legacy: list[str] = []
    for partition in range(spec.partitions):
        queue = spec.queue(partition)
        try:
            channel.queue_declare(queue, durable=True, arguments=_queue_arguments(spec))
        except pika.exceptions.ChannelClosedByBroker as e:
            if not _lacks_delivery_limit(e):
                raise UsageError(
                    f"queue {queue} already exists with other settings ({e.reply_text}): "
                    f"delete it or use another stream name"
                ) from None
            legacy.append(queue)  # an older partq's queue: it stays, the policy upgrades it
            channel = connection.channel()
            channel.queue_declare(queue, passive=True)
        channel.queue_bind(queue, spec.exchange, routing_key=str(partition))
    if legacy:
        log.warning(
            "%d queues of stream %s have no delivery limit (created by an older partq): a "
            "quorum queue then returns messages to its back, which can reorder a key during "
            "a handoff. Upgrade them with: %s",
            len(legacy), spec.name, upgrade_policy_command(spec),
        )  # fmt: skip
    channel.queue_declare(
        spec.dead_letter_queue, durable=True, arguments={"x-queue-type": spec.queue_type}
    )
    channel.close()


def delete_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    channel = connection.channel()
    for partition in range(spec.partitions):
        channel.queue_delete(spec.queue(partition))
    channel.queue_delete(spec.dead_letter_queue)
    channel.exchange_delete(spec.exchange)
    channel.close()


@dataclass(frozen=True, slots=True)
class QueueStats:
    partition: int
    queue: str
    messages: int | None  # None: the queue does not exist
    consumers: int | None


def queue_stats(connection: pika.BlockingConnection, spec: StreamSpec) -> list[QueueStats]:
    """Depth and consumer count of every partition queue (passive declares, no plugin needed)."""
    stats: list[QueueStats] = []
    channel: BlockingChannel | None = None
    for partition in range(spec.partitions):
        queue = spec.queue(partition)
        if channel is None or not channel.is_open:
            channel = connection.channel()
        try:
            ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            stats.append(QueueStats(partition, queue, None, None))
            continue
        stats.append(
            QueueStats(partition, queue, ok.method.message_count, ok.method.consumer_count)
        )
    if channel is not None and channel.is_open:
        channel.close()
    return stats


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
