"""``partq dlq``: parked keys and the dead-letter queue, read and acted on by an operator.

Parked keys (``on_failure = park``) are listed from etcd with the depth of each key's
parking queue. A redrive or purge is a *control message* published into the key's own
partition: the partition's owner acts on it in queue order (see
:mod:`partq.consumers.handling.parking`), so everything newer of the key waits behind the replay,
and an
interrupted redrive is finished by whoever owns the partition next. Running it again is
harmless: a key that is no longer parked is left alone. The message's ``user_id`` names the
user that sends it; RabbitMQ refuses a ``user_id`` other than the publishing user, and the
consumers obey only the stream's operator and admin users (:mod:`partq.consumers.control.redrive`).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import pika
import pika.exceptions
from partq.coordinator.store.group import Group, Parked
from partq.producer.contract import (
    HEADER_CONTROL,
    HEADER_GROUP,
    HEADER_PARTITION,
    StreamSpec,
    encode_key,
    key_id,
)
from partq.producer.registry import Registry
from pika.adapters.blocking_connection import BlockingChannel

from partq.kernel.amqp import AmqpURL, blocking_connection

__all__ = [
    "ParkedKey",
    "dead_letter_depth",
    "parked_keys",
    "requests",
    "sender",
    "wait_unparked",
]

Action = Literal["redrive", "purge"]


@dataclass(frozen=True, slots=True)
class ParkedKey:
    record: Parked
    queue: str
    messages: int | None  # None: the parking queue is missing

    def to_dict(self) -> dict[str, object]:
        r = self.record
        return {
            "key": r.key_text,
            "key_id": r.key_id,
            "partition": r.partition,
            "messages": self.messages,
            "queue": self.queue,
            "error_type": r.error_type,
            "error": r.error,
            "message_id": r.message_id,
            "member": r.member,
            "parked_at": r.at,
            "redrive_error": r.redrive_error or None,  # why the last redrive failed
        }


def parked_keys(
    registry: Registry, amqp_url: AmqpURL, spec: StreamSpec, key: str | bytes | None = None
) -> list[ParkedKey]:
    """The stream's parked keys (or only ``key``), with their parking queues' depths."""
    records = Group(registry.client, registry.where, spec.scope, report=False).parked()
    if key is not None:
        records = {n: r for n, r in records.items() if n == key_id(key)}
    found: list[ParkedKey] = []
    with blocking_connection(amqp_url) as connection:
        for record in sorted(records.values(), key=lambda r: (r.at, r.key_id)):
            queue = spec.park_queue(record.key)
            found.append(ParkedKey(record, queue, _depth(connection, queue)))
    return found


def dead_letter_depth(amqp_url: AmqpURL, spec: StreamSpec) -> int | None:
    with blocking_connection(amqp_url) as connection:
        return _depth(connection, spec.dead_letter_queue)


def _depth(connection: pika.BlockingConnection, queue: str) -> int | None:
    channel = connection.channel()
    try:
        frame = channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return None
        raise
    channel.close()
    return int(frame.method.message_count)


def requests(
    amqp_url: AmqpURL, spec: StreamSpec, records: Mapping[str, Parked], action: Action
) -> dict[str, str]:
    """Publish the control message for each record's key into the key's partition under the
    current layout (confirmed), over one connection; each record's name -> the message id,
    which the owner names in the key's record if the replay fails. The current layout's,
    not the record's: after a resize moved the key, its new messages reach that partition,
    whose owner parks them behind the parked ones; the replay must run on that same worker,
    in line with them, or a message parked during the replay on another worker would go
    with the deleted parking queue."""
    if not records:
        return {}
    with blocking_connection(amqp_url) as connection:
        user = sender(connection, spec.exchange)
        channel = connection.channel()
        channel.confirm_delivery()
        return {
            name: _request(channel, spec, record, action, user) for name, record in records.items()
        }


def _request(
    channel: BlockingChannel, spec: StreamSpec, record: Parked, action: Action, user: str
) -> str:
    key: str | bytes = record.key
    with contextlib.suppress(UnicodeDecodeError):
        key = record.key.decode("utf-8")
    partition = spec.layout.partition_for(record.key)
    headers: dict[str, object] = {
        **encode_key(key),
        HEADER_PARTITION: partition,
        HEADER_CONTROL: action,
        HEADER_GROUP: spec.group,  # the other groups' queues get a copy too: they drop it
    }
    properties = pika.BasicProperties(
        delivery_mode=2,
        message_id=f"partq-{action}-{record.key_id}-{time.time_ns()}",
        headers=headers,
        app_id="partq",
        user_id=user,
    )
    routing_key = spec.layout.routing_key(partition)  # the current epoch's
    channel.basic_publish(spec.exchange, routing_key, b"", properties, mandatory=True)
    return str(properties.message_id)


_WHO = re.compile(r"authenticated user was '(.*)'")


def sender(connection: pika.BlockingConnection, exchange: str) -> str:
    """The user ``connection`` logged in as: the URL's, or for a certificate login (SASL
    EXTERNAL) the one RabbitMQ names when it refuses a publish to ``exchange`` (which the
    user may write to) whose ``user_id`` is not it."""
    username = getattr(connection._impl.params.credentials, "username", None)
    if username:
        return str(username)
    channel = connection.channel()
    channel.confirm_delivery()
    probe = pika.BasicProperties(user_id="partq-who-am-i")  # routed nowhere if it were us
    try:
        channel.basic_publish(exchange, "", b"", probe)
    except pika.exceptions.ChannelClosedByBroker as e:
        found = _WHO.search(e.reply_text)
        if e.reply_code == 406 and found:
            return found.group(1)
        raise
    channel.close()
    return "partq-who-am-i"


def wait_unparked(
    registry: Registry,
    stream: str,
    requests: dict[str, str],
    timeout: float,
    interval: float = 0.25,
) -> tuple[set[str], dict[str, Parked]]:
    """Wait until each key id of ``requests`` (key id -> request id) is unparked, or its
    owner reported that the replay of its request failed: (the key ids still parked with
    no report, {key id: the record naming the failed replay}).
    """
    group = Group(registry.client, registry.where, stream, report=False)
    deadline = time.monotonic() + timeout
    left, failed = set(requests), dict[str, Parked]()
    for _ in range(int(timeout / interval) + 2):
        parked = group.parked()
        left &= set(parked)
        failed |= {n: parked[n] for n in left if parked[n].redrive == requests[n]}
        left -= set(failed)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(interval)
    return left, failed
