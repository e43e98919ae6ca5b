"""Per-key parking (``on_failure = park``): a key whose message exhausted its retries waits.

That message and every later message of its key go, in order, to the key's own parking queue
(``partq.S.park.<hash>``, bound under its name to the stream's parking exchange
``partq.S.park``) while other keys flow on; the key's record in etcd (``parked/<key id>``)
makes every later owner of the partition park it too. ``partq dlq redrive`` publishes a
*control message* into the key's partition; the partition's worker, the only writer of the
parking queue, replays the queue through the handler in order, ahead of everything newer of
that key (queued behind the control message), then deletes the record and the queue. ``partq
dlq purge`` does the same without the handler. A crash anywhere leaves the control message
or the parked message unacked: the next owner goes on where it stopped; nothing is lost, and
a message parked twice (its owner killed before the ack) is replayed once.

Not through the dead-letter exchange, whose *read* right would let a consumer copy the DLQ
(docs/security.md); an older partq's stream parks through it until ``partq.S.park`` exists.

At most :data:`MAX_PARKED_KEYS` keys of a stream are parked (each has a queue): past that, a
key whose message exhausts its retries is not parked; the message goes to the dead-letter
queue (``x-partq-error-type: TooManyParkedKeys``, the handler's error in the text), and the
key's later messages flow on, as with ``on_failure = dead-letter``.

Order of writes when a key is parked: the etcd record first, then the message is published
to the parking queue (with a confirm), then acked. A later owner sees the record before it
can see the claim released (etcd's revision order), so it never handles the key's next
message ahead of the parked ones.

Threads. Parking runs on the partition workers' threads (a keyed worker's pool threads),
several at once. :class:`Parking`'s lock serialises its one blocking AMQP connection and
channel (``_connection``, ``_channel``, ``_declared``, ``_exchange``); a redrive replays on
a connection of its own. :class:`ParkedKeys` (:mod:`partq.consumers.handling.parkedkeys`) is
written by the controller and by the workers, and read by both, under its lock.
:class:`ParkStalls` is written by the workers and read by the controller (``/readyz``, load
reports) under its lock; ``on_change``, called outside it, queues a ``ParkStall`` event for
the controller. etcd is reached through ``Group``, whose only state is locked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from partq.consumers import metrics
from partq.consumers.broker.port import Delivery
from partq.consumers.control import redrive as control
from partq.consumers.handling.parkedkeys import ParkedKeys, written_by_holder
from partq.coordinator.store.codec import Parked
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec, key_bytes, key_id, long_key_id
from partq.producer.queue_arguments import park_queue_arguments

from partq.kernel.amqp import AmqpURL, connect_blocking
from partq.kernel.errors import PartqError

__all__ = [
    "MAX_PARKED_KEYS",
    "ParkStalls",
    "ParkedKeys",
    "Parking",
    "TooManyParkedKeys",
    "shown_key",
    "too_many",
    "written_by_holder",
]

log = logging.getLogger("partq.consumer.parking")

PARKED_HEADER = "x-partq-parked"  # on a parked message: why ("failed" or "key parked")
# Parking queues per stream: each parked key has one, and a broker slows down with tens of
# thousands of queues. A consumer's AMQP rights cannot count queues (see docs/security.md).
MAX_PARKED_KEYS = 1000


class TooManyParkedKeys(PartqError):
    """A key was not parked: the stream has :data:`MAX_PARKED_KEYS` parked keys already."""


def too_many(stream: str, count: int, limit: int, error: BaseException) -> TooManyParkedKeys | None:
    """Why a key that failed with ``error`` may not be parked while ``count`` keys of
    ``stream`` are, or None if it may."""
    if count < limit:
        return None
    return TooManyParkedKeys(
        f"{type(error).__name__}: {error} (not parked: stream {stream!r} has {count} parked "
        f"keys, the limit; redrive or purge some with `partq dlq`)"
    )


_SHOWN = 80  # characters of a key, or of an error, in a log line (a key may be ~128 KiB)
_SUMMARY_EVERY = 60.0  # seconds between "still failing" lines of one stalled partition


def shown_key(key: str | bytes | None) -> str:
    """A key for a log line: its ``repr``, cut short with its length when long."""
    text = repr(key)
    if key is None or len(text) <= _SHOWN:
        return text
    return f"{text[:_SHOWN]}... ({len(key_bytes(key))} bytes)"


def _shown_error(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 4 * _SHOWN else text[: 4 * _SHOWN] + "..."


@dataclass
class _Stall:
    key: str  # shown_key
    since: float
    logged: float
    attempts: int = 0
    error: str = ""


class ParkStalls:
    """The partitions whose worker cannot park a message now (etcd or RabbitMQ refusing):
    such a partition waits, so it is told everywhere an operator looks: the gauge
    ``partq_consumer_parking_stalled_partitions``, ``/readyz`` (``on_change`` tells the
    daemon), the member's load report (``partq status``), and the log: one warning when a
    stall begins, a summary every minute while it lasts, one line when it ends."""

    def __init__(self, labels: tuple[str, str], on_change: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._stalls: dict[int, _Stall] = {}
        self._on_change = on_change
        self._failures = metrics.PARK_FAILURES.labels(*labels)
        self._gauge = metrics.PARKING_STALLED.labels(*labels)

    def stalled(self) -> list[int]:
        with self._lock:
            return sorted(self._stalls)

    def failed(self, partition: int, key: str | bytes, error: BaseException) -> None:
        """A park of ``key``'s message on ``partition`` failed (the worker tries again)."""
        self._failures.inc()
        now = time.monotonic()
        with self._lock:
            stall = self._stalls.get(partition)
            began = stall is None
            if stall is None:
                stall = self._stalls[partition] = _Stall(shown_key(key), now, now)
            stall.attempts += 1
            stall.error = _shown_error(error)
            summary = not began and now - stall.logged >= _SUMMARY_EVERY
            if summary:
                stall.logged = now
            count = len(self._stalls)
        if began:
            self._gauge.set(count)
            log.warning(
                "partition %d: cannot park key %s (%s): the partition waits and tries again; "
                "a summary follows every %.0fs",
                partition,
                stall.key,
                stall.error,
                _SUMMARY_EVERY,
            )
            self._on_change()
        elif summary:
            log.warning(
                "partition %d: parking key %s still fails: %d attempts in %.0fs, the last: %s",
                partition,
                stall.key,
                stall.attempts,
                now - stall.since,
                stall.error,
            )

    def ended(self, partition: int, parked: bool) -> None:
        """The worker parked the message (``parked``), or stopped trying (it is not acked)."""
        with self._lock:
            stall = self._stalls.pop(partition, None)
            count = len(self._stalls)
        if stall is None:
            return
        self._gauge.set(count)
        log.info(
            "partition %d: key %s %s after %d failed attempts in %.0fs",
            partition,
            stall.key,
            "parked" if parked else "left unparked (the partition stopped here)",
            stall.attempts,
            time.monotonic() - stall.since,
        )
        self._on_change()


class Parking:
    """The I/O of parking for one consumer: records in etcd, parking queues in RabbitMQ.

    One blocking AMQP connection, shared by the workers under a lock and opened again
    after a failure; every method raises on failure and the caller keeps its delivery.
    """

    def __init__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        member: str,
        group: Group,
        parked: ParkedKeys,
        on_stall: Callable[[], None] = lambda: None,
        *,
        limit: int = MAX_PARKED_KEYS,
    ) -> None:
        """``on_stall``: a partition began or ended waiting for a park (:class:`ParkStalls`)."""
        self.stalls = ParkStalls((spec.scope, member), on_stall)
        self.url = url
        self.spec = spec
        self.limit = limit
        self.senders = control.senders(spec.scope, control.users_of(url))
        self.member = member
        self.group = group
        self.parked = parked
        self._lock = threading.Lock()
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None
        self._declared: set[str] = set()
        self._exchange: str | None = None  # what this connection parks through, once known
        self._warned = False

    def close(self) -> None:
        with self._lock:
            self._drop()

    def refuse(self, error: BaseException) -> TooManyParkedKeys | None:
        """Why a key that failed with ``error`` may not be parked now, or None if it may."""
        return too_many(self.spec.scope, len(self.parked), self.limit, error)

    # -- parking ---------------------------------------------------------------------------

    def park(
        self,
        delivery: Delivery,
        key: str | bytes,
        error: BaseException | None,
        attempts: int,
        session: Session,
    ) -> None:
        """Park ``delivery`` (its key's record first when ``error`` parks the key now, while
        our claim on its partition is on ``session``'s lease)."""
        name = key_id(key)
        if error is not None and self.parked.get(name) is None:
            record = Parked(
                name,
                delivery.partition,
                "".join(traceback.format_exception_only(error)).strip()[:2000],
                type(error).__name__,
                str(delivery.properties.message_id or ""),
                self.member,
                time.time(),
                long_key=key_bytes(key) if long_key_id(name) else b"",
            )
            self.parked.expect(name)  # so the watch's echo is known as ours
            revision = self.group.park(record, session)
            self.parked.apply(name, record, revision)
        headers = dict(delivery.properties.headers or {})
        headers[PARKED_HEADER] = "failed" if error is not None else "key parked"
        headers["x-partq-partition"] = delivery.partition
        headers["x-partq-member"] = self.member
        if error is not None:
            headers["x-partq-error"] = "".join(traceback.format_exception_only(error)).strip()[
                :2000
            ]
            headers["x-partq-error-type"] = type(error).__name__
            headers["x-partq-attempts"] = attempts
        props = delivery.properties
        properties = pika.BasicProperties(
            delivery_mode=2,
            message_id=props.message_id,
            timestamp=props.timestamp,
            headers=headers,
            app_id=props.app_id,
            content_type=props.content_type,
            content_encoding=props.content_encoding,
            correlation_id=props.correlation_id,
            type=props.type,
        )
        queue = self.spec.park_queue(key)
        with self._lock:
            self._with_channel(
                lambda channel: self._publish(channel, queue, delivery.body, properties)
            )

    def _publish(self, channel: Any, queue: str, body: bytes, properties: Any) -> None:
        if self._exchange is None:
            self._exchange = self._park_exchange(channel)
            channel = self._channel  # a refused declare closed the one it was made on
        if queue not in self._declared:
            channel.queue_declare(queue, durable=True, arguments=park_queue_arguments(self.spec))
            channel.queue_bind(queue, self._exchange, routing_key=queue)
            self._declared.add(queue)
        channel.basic_publish(self._exchange, queue, body, properties, mandatory=True)

    def _park_exchange(self, channel: Any) -> str:
        """The stream's parking exchange, declared if absent and this user may; else (an older
        partq's stream) the dead-letter exchange, as that partq parked. The lock is held."""
        exchange = self.spec.park_exchange
        try:
            channel.exchange_declare(exchange, passive=True)  # needs no right
            return exchange
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 404:
                raise
        self._channel = None
        self._open()
        try:
            self._channel.exchange_declare(exchange, exchange_type="direct", durable=True)
            return exchange
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 403:  # ACCESS_REFUSED: no configure right on it
                raise
        self._channel = None
        self._open()
        if not self._warned:
            self._warned = True
            log.warning("stream %s has no parking exchange %s (an older partq's) and this user "
                        "may not declare it: parking through the dead-letter exchange; run "
                        "`partq stream create %s` again to add it", self.spec.name, exchange,
                        self.spec.name)  # fmt: skip
        return self.spec.dead_letter_exchange

    # -- replaying -------------------------------------------------------------------------

    def replay(
        self,
        partition: int,
        key: str | bytes,
        handle: Callable[[Delivery], bool],
        stopped: threading.Event,
    ) -> bool:
        """Hand the key's parked messages to ``handle`` in order, each acked once handled;
        then delete the record and the queue. False (the key stays parked) when ``handle``
        fails (its message stays at the head) or ``stopped`` is set."""
        queue = self.spec.park_queue(key)
        with self._lock:
            connection = connect_blocking(self.url, name=f"partq-redrive-{self.member}")
        try:
            channel = connection.channel()
            replayed = copies = 0
            seen: set[tuple[str, bytes]] = set()  # (message id, body digest) replayed
            while not stopped.is_set():
                try:
                    method, header, body = channel.basic_get(queue, auto_ack=False)
                except pika.exceptions.ChannelClosedByBroker as e:
                    if e.reply_code != 404:  # NOT_FOUND: nothing was ever parked in it
                        raise
                    break
                if method is None:
                    break
                # An owner killed between parking a message and acking it leaves the
                # message to the next owner, which parks it again: the same id and body
                # twice in the queue. The copy is dropped, not handled a second time.
                copy = (str(header.message_id or ""), hashlib.sha256(body).digest())
                if header.message_id and copy in seen:
                    channel.basic_ack(method.delivery_tag)
                    copies += 1
                    continue
                delivery = Delivery(partition, channel, method.delivery_tag, True, header, body)
                if not handle(delivery):
                    channel.basic_nack(method.delivery_tag, requeue=True)  # back to the head
                    return False
                channel.basic_ack(method.delivery_tag)
                seen.add(copy)
                replayed += 1
            if stopped.is_set():
                return False
            log.info(
                "key %s: %d parked messages replayed (%d copies left by a crash dropped)",
                shown_key(key),
                replayed,
                copies,
            )
        finally:
            if connection.is_open:
                connection.close()
        self._forget(key)
        return True

    def report_redrive_failed(
        self, key: str | bytes, request: str, error: BaseException | None
    ) -> None:
        """Tell ``partq dlq redrive`` (waiting for ``request``) that the replay failed, in
        the key's record: the command returns with the error instead of waiting it out."""
        name = key_id(key)
        record = self.parked.get(name)
        if record is None:
            return
        reason = "".join(traceback.format_exception_only(error)).strip() if error else "failed"
        failed = dataclasses.replace(record, redrive=request or "?", redrive_error=reason[:2000])
        self.parked.expect(failed.key_id)
        revision = self.group.report_redrive_failed(failed)
        if revision:
            self.parked.apply(name, failed, revision)

    def purge(self, key: str | bytes) -> None:
        """Drop the key's parked messages, then its record: the key flows again."""
        self._forget(key)

    def _forget(self, key: str | bytes) -> None:
        queue = self.spec.park_queue(key)
        with self._lock:
            self._with_channel(lambda channel: channel.queue_delete(queue))
            self._declared.discard(queue)
        name = key_id(key)
        revision = self.group.unpark(name)
        self.parked.apply(name, None, revision)

    # -- the connection ------------------------------------------------------------------

    def _with_channel(self, action: Callable[[Any], None]) -> None:
        """``action(channel)`` on a confirming channel, once more on a new connection if the
        first try failed on a broken one (the lock is held)."""
        for last in (False, True):
            try:
                if self._channel is None or not self._channel.is_open:
                    self._open()
                action(self._channel)
                return
            except (pika.exceptions.AMQPError, OSError):
                self._drop()
                if last:
                    raise

    def _open(self) -> None:
        if self._connection is None or not self._connection.is_open:
            self._connection = connect_blocking(self.url, name=f"partq-park-{self.member}")
            self._declared.clear()
            self._exchange = None
        self._channel = self._connection.channel()
        self._channel.confirm_delivery()

    def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._declared.clear()
        self._exchange = None
        if connection is not None and connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()
