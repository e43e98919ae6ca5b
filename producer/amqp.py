"""RabbitMQ edge: URLs, connections, a stream's topology and its queue statistics.

pika's errors are translated here into :mod:`producer.errors`.
"""

from __future__ import annotations

import contextlib
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
    StreamSpec,
    encode_key,
)
from producer.errors import BrokerUnavailable, UsageError

__all__ = [
    "DEFAULT_AMQP_URL",
    "QueueStats",
    "blocking_connection",
    "connection_parameters",
    "declare_stream",
    "delete_stream",
    "message_properties",
    "queue_stats",
    "redact_url",
]

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
    return {"x-single-active-consumer": True, "x-queue-type": spec.queue_type}


def declare_stream(connection: pika.BlockingConnection, spec: StreamSpec) -> None:
    """Declare the exchange, the P single-active-consumer queues and the dead-letter queue.

    Idempotent. A queue that exists with other arguments is reported, not replaced.
    """
    channel = connection.channel()
    channel.exchange_declare(spec.exchange, exchange_type="direct", durable=True)
    for partition in range(spec.partitions):
        queue = spec.queue(partition)
        try:
            channel.queue_declare(queue, durable=True, arguments=_queue_arguments(spec))
        except pika.exceptions.ChannelClosedByBroker as e:
            raise UsageError(
                f"queue {queue} already exists with other settings ({e.reply_text}): "
                f"delete it or use another stream name"
            ) from None
        channel.queue_bind(queue, spec.exchange, routing_key=str(partition))
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
