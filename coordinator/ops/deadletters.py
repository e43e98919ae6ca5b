"""The dead-letter queue ``partq.S.dlq``, read and acted on by an operator without losing or
reordering it.

How a read leaves the queue as it was (measured on classic and quorum queues, RabbitMQ
3.10 and 4.0: ``benchmarks/dlq_peek.py``, docs/benchmarks.md): one *exclusive* consumer
with prefetch n takes exactly the first n messages, acks none and closes its channel; the
broker gives them back at the head, in order, also while new dead letters arrive. What it
avoids, each measured to reorder a quorum queue: ``basic.get`` (many returned gets come
back out of order), ``basic.nack``/``reject`` with requeue (appended at the back on 3.x
without a delivery limit), and deliveries pika received but had not handed over when the
channel closes (pika nacks those): taking exactly the prefetch leaves the broker no credit
to send more. It reads only when the queue has no other consumer, and consumes
exclusively (RabbitMQ 3.10 enforces that on classic queues only): two readers at once would
interleave what they give back. A quorum queue counts each give-back in
``x-delivery-count`` (:attr:`DeadLetter.returns`).

A redrive or purge takes the first messages the same way and acks those it acts on (a
redrive only once the broker confirmed the copy published into the partition: at least
once, never lost); the others go back in order when the channel closes. It acts only on the
messages that were in the queue when it began, so a redriven message that fails again and
comes back is left for the next run.

Both look at a window of the queue's head (``WINDOW`` by default, at most ``MAX_PREFETCH``):
the messages a keyed redrive or purge passes over stay unacked in front, in order, so what
it looks at is the window plus what it acted on. :class:`Read` and :class:`Acted` say how
many it looked at of how many, so a command can say so rather than speak for the rest.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pika
import pika.exceptions
from partq.producer.contract import (
    DEAD_LETTER_HEADERS,
    HEADER_ATTEMPTS,
    HEADER_CONTROL,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_FAILED_MS,
    HEADER_FAILED_PARTITION,
    HEADER_GROUP,
    HEADER_KEY_B64,
    HEADER_MEMBER,
    HEADER_PARTITION,
    StreamSpec,
    decode_key,
    key_bytes,
    key_id,
)
from pika.adapters.blocking_connection import BlockingChannel

from partq.kernel.amqp import MAX_PREFETCH, AmqpURL, blocking_connection
from partq.kernel.errors import MessageNacked, MessageUnroutable, UsageError

__all__ = ["MAX_PREFETCH", "WINDOW", "Acted", "DeadLetter", "Read", "act", "letter_from", "read"]

Action = Literal["redrive", "purge"]
WINDOW = 10_000  # messages held at once by default (a prefetch count is at most MAX_PREFETCH)
_WAIT = 10.0  # seconds to wait for a window's next delivery before giving up on it
_ALONE_CHECKS, _ALONE_INTERVAL = 25, 0.2  # wait up to 5 s for another reader to go away


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One message of the dead-letter queue, as its headers describe it (any may be missing:
    the broker dead-letters on a quorum queue's delivery limit without partq's headers)."""

    position: int  # 0: the head of the queue
    key: str | bytes | None
    partition: int | None  # where it failed, else the partition its producer named
    error_type: str | None
    error: str | None
    attempts: int | None  # handler attempts made
    failed_ms: int | None
    member: str | None
    message_id: str | None
    size: int
    returns: int  # times the queue gave it back (x-delivery-count; quorum queues only)
    control: str | None = None  # a `partq dlq` request the consumer refused (forged)

    @property
    def key_text(self) -> str | None:
        """Like :attr:`partq.coordinator.store.codec.Parked.key_text`: text, or ``b64:<base64>``."""
        if self.key is None or isinstance(self.key, str):
            return self.key
        try:
            return self.key.decode("utf-8")
        except UnicodeDecodeError:
            return "b64:" + base64.b64encode(self.key).decode("ascii")

    def matches(self, key: str | bytes | None) -> bool:
        """``key`` None: every dead letter; else those of that key."""
        return key is None or (self.key is not None and key_bytes(self.key) == key_bytes(key))

    def to_dict(self) -> dict[str, object]:
        return {
            "position": self.position,
            "key": self.key_text,
            "key_id": None if self.key is None else key_id(self.key),
            "partition": self.partition,
            "error_type": self.error_type,
            "error": self.error,
            "attempts": self.attempts,
            "failed_ms": self.failed_ms,
            "member": self.member,
            "message_id": self.message_id,
            "size": self.size,
            "returns": self.returns,
            "control": self.control,
        }


def letter_from(position: int, properties: pika.BasicProperties, body: bytes) -> DeadLetter:
    """What a dead letter's properties say; a malformed header reads as missing."""
    headers: Mapping[str, Any] = properties.headers or {}
    key: str | bytes | None
    try:  # strictly, as the consumer reads it (a malformed key was dead-lettered for it)
        if HEADER_KEY_B64 in headers:
            key = base64.b64decode(headers[HEADER_KEY_B64], validate=True)
        else:
            key = decode_key(headers)
    except (ValueError, TypeError):
        key = None
    partition = _int(headers.get(HEADER_FAILED_PARTITION))
    return DeadLetter(
        position=position,
        key=key,
        partition=partition if partition is not None else _int(headers.get(HEADER_PARTITION)),
        error_type=_text(headers.get(HEADER_ERROR_TYPE)),
        error=_text(headers.get(HEADER_ERROR)),
        attempts=_int(headers.get(HEADER_ATTEMPTS)),
        failed_ms=_int(headers.get(HEADER_FAILED_MS)),
        member=_text(headers.get(HEADER_MEMBER)),
        message_id=_text(properties.message_id),
        size=len(body),
        returns=_int(headers.get("x-delivery-count")) or 0,
        control=_text(headers.get(HEADER_CONTROL)),
    )


def republished(properties: pika.BasicProperties, group: str) -> pika.BasicProperties:
    """A dead letter's properties for its partition: as published, without the bookkeeping
    of its failure (:data:`~partq.producer.contract.DEAD_LETTER_HEADERS`), for ``group``
    alone (:data:`~partq.producer.contract.HEADER_GROUP`: the stream's exchange copies it to
    every group's queue, and the others drop it)."""
    headers = {k: v for k, v in (properties.headers or {}).items() if k not in DEAD_LETTER_HEADERS}
    headers[HEADER_GROUP] = group
    return pika.BasicProperties(
        content_type=properties.content_type,
        content_encoding=properties.content_encoding,
        headers=headers,
        delivery_mode=2,
        correlation_id=properties.correlation_id,
        message_id=properties.message_id,
        timestamp=properties.timestamp,
        type=properties.type,
        app_id=properties.app_id,
    )


def target(spec: StreamSpec, letter: DeadLetter) -> int | None:
    """The partition a redrive publishes ``letter`` into: its key's (the one hash), else the
    partition it failed in; None when it names neither, or is a refused control request
    (replaying it would ask the consumer again for what it refused)."""
    if letter.control is not None:
        return None
    if letter.key is not None:
        return spec.partition_for(letter.key)
    if letter.partition is not None and 0 <= letter.partition < spec.partitions:
        return letter.partition
    return None


@dataclass(frozen=True, slots=True)
class Read:
    depth: int  # messages ready in the queue when the read began
    letters: tuple[DeadLetter, ...]  # the first min(depth, window), head first

    @property
    def complete(self) -> bool:
        """Whether every message of the queue was looked at."""
        return len(self.letters) >= self.depth


Taken = list[tuple[Any, pika.BasicProperties, bytes]]  # (Basic.Deliver, properties, body)


@contextlib.contextmanager
def _window(
    connection: pika.BlockingConnection, queue: str, most: int
) -> Iterator[tuple[BlockingChannel, int, Taken]]:
    """The first ``min(ready, most)`` messages of ``queue``, unacked, with the ready count;
    closing the channel gives back in order whatever was not acked (see the module doc)."""
    channel = connection.channel()
    try:
        frame = channel.queue_declare(queue, passive=True).method
        for _ in range(_ALONE_CHECKS):  # the broker may count a reader that just closed
            if not frame.consumer_count:
                break
            time.sleep(_ALONE_INTERVAL)
            frame = channel.queue_declare(queue, passive=True).method
        if frame.consumer_count:  # its messages would interleave with ours when given back
            raise _busy(queue)
        depth = int(frame.message_count)
        wanted = min(depth, most, MAX_PREFETCH)
        taken: Taken = []
        if wanted:
            channel.basic_qos(prefetch_count=wanted)
            consuming = channel.consume(queue, exclusive=True, inactivity_timeout=_WAIT)
            for method, properties, body in consuming:
                if method is None:  # fewer than counted (another reader took some): stop
                    break
                taken.append((method, properties, body))
                if len(taken) >= wanted:  # no credit left: nothing more can be in flight
                    break
        yield channel, depth, taken
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 403 and "exclusive" in e.reply_text:
            raise _busy(queue) from None
        raise
    finally:
        if channel.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                channel.close()


def _busy(queue: str) -> UsageError:
    return UsageError(
        f"another consumer is reading {queue} (another `partq dlq` command, or a program of "
        f"yours): partq reads it only alone, to give it back in order; run this one when "
        f"that one is done"
    )


def read(amqp_url: AmqpURL, spec: StreamSpec, window: int = WINDOW) -> Read:
    """The first ``window`` dead letters of ``spec``'s stream, left where they are."""
    with (
        blocking_connection(amqp_url, name="partq-dlq-read") as connection,
        _window(connection, spec.dead_letter_queue, window) as (_, depth, taken),
    ):
        letters = tuple(letter_from(i, p, b) for i, (_, p, b) in enumerate(taken))
    return Read(depth, letters)


@dataclass(frozen=True, slots=True)
class Acted:
    done: int  # redriven (confirmed in their partitions) or purged
    kept: int  # of the messages there when it began, those still in the queue
    unroutable: int  # of those looked at and kept: no key and no partition, or a refused
    # control request
    depth: int = 0  # messages in the queue when it began
    looked: int = 0  # of those, the first ``looked`` were looked at (the rest were not)

    @property
    def complete(self) -> bool:
        """Whether every message that was in the queue was looked at."""
        return self.looked >= self.depth


def act(
    amqp_url: AmqpURL,
    spec: StreamSpec,
    action: Action,
    key: str | bytes | None = None,
    window: int = WINDOW,
) -> Acted:
    """Redrive (publish into its partition, confirmed, then ack) or purge (ack) every dead
    letter of ``key`` (None: all) among those in the queue now, in queue order, looking at
    the first ``window`` it keeps (plus those it acts on): :attr:`Acted.looked` says how
    many it looked at."""
    done = unroutable = held = 0
    queue = spec.dead_letter_queue
    with blocking_connection(amqp_url, name=f"partq-dlq-{action}") as connection:
        out = connection.channel()
        out.confirm_delivery()
        depth = int(out.queue_declare(queue, passive=True).method.message_count)
        left = depth  # of the originals, those still in the queue
        for _ in range(left + 1):  # each round acts on at least one message, or stops
            acted = held = unroutable = 0
            with _window(connection, queue, min(left, window)) as (channel, _, taken):
                for method, properties, body in taken:
                    letter = letter_from(held, properties, body)
                    partition = target(spec, letter)
                    if not letter.matches(key) or (action == "redrive" and partition is None):
                        held += 1
                        unroutable += letter.matches(key)
                        continue
                    if action == "redrive" and partition is not None:  # None: held above
                        _publish(out, spec, partition, properties, body)
                    channel.basic_ack(method.delivery_tag)
                    acted += 1
            done += acted
            left -= acted
            if acted == 0 or held >= left:  # what remains of the originals is kept
                break
    # the messages kept stay at the head, in order: the last window held all of them
    return Acted(done, left, unroutable, depth, min(depth, done + held))


def _publish(
    channel: BlockingChannel,
    spec: StreamSpec,
    partition: int,
    properties: pika.BasicProperties,
    body: bytes,
) -> None:
    try:
        channel.basic_publish(
            spec.exchange,
            spec.layout.routing_key(partition),  # the current epoch's: "q", or "E.q" resized
            body,
            republished(properties, spec.group),
            mandatory=True,
        )
    except pika.exceptions.UnroutableError:
        raise MessageUnroutable(
            f"partition {partition} of {spec.scope} has no queue bound under layout epoch "
            f"{spec.epoch} (a resize switched it meanwhile, or run `partq stream create "
            f"{spec.name}` again); the dead letter stays in {spec.dead_letter_queue}: run "
            f"the command again"
        ) from None
    except pika.exceptions.NackError:
        raise MessageNacked(
            f"RabbitMQ refused the copy for partition {partition} of {spec.scope}; the dead "
            f"letter stays in {spec.dead_letter_queue}: run the command again"
        ) from None
