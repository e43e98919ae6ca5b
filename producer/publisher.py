"""The producer SDK: keyed, persistent, confirmed publishes with a bounded window.

One I/O thread owns a pika ``SelectConnection``; callers from any thread hand
it messages through an outbox and get a ``Future`` back. Confirms are
pipelined: up to ``window`` messages are unconfirmed at once, and ``publish``
blocks when the window is full (backpressure), so memory stays bounded.

On connection loss the producer reconnects with backoff and **republishes every
unconfirmed message, in the original order, before any newer one**, with the
same ``message_id``; a message whose confirm was lost in flight may therefore
arrive twice (at-least-once; deduplicate by ``message_id``). If no connection
can be made within ``reconnect_timeout`` every pending future fails with
:class:`ConnectionLost`. A future never succeeds without the broker's confirm.

No message can poison the producer. ``publish`` encodes the message's properties
in the caller's thread, once (pika then sends those bytes as they are), so what
AMQP cannot carry (an int beyond 64 bits, a set, a ``message_id`` over 255 bytes,
a key too long for one frame) raises :class:`UsageError` there. A message the
broker refuses (a body above its ``max_message_size``) fails its own future
with :class:`PublishFailed` and is not sent again; the others are republished
in order. Should the I/O thread ever fail, every pending and later publish fails
with :class:`ProducerClosed` naming the cause.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from types import TracebackType
from typing import Any, Protocol

import pika
import pika.data
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from kernel.amqp import AmqpURL, Nodes, unavailable
from kernel.backoff import Backoff
from kernel.errors import (
    BrokerUnavailable,
    ConnectionLost,
    MessageNacked,
    MessageUnroutable,
    ProducerClosed,
    PublishFailed,
    UsageError,
)
from kernel.settings import Settings
from producer import metrics
from producer.contract import StreamSpec, validate_stream_name
from producer.futures import PublishFuture
from producer.registry import read_spec_from_settings
from producer.topology import check_partition_queues, encoded_properties, message_properties

__all__ = ["Producer", "Receipt", "SpecSource"]

log = logging.getLogger("partq.producer")

# A header frame is 7 bytes of frame header, then class, weight and body size (12 bytes),
# then the encoded properties, then the frame-end byte: the properties get frame_max - 20.
_HEADER_FRAME_OVERHEAD = 20
_NACK_RECYCLE = 5.0  # seconds between reconnects caused by nacks
_SHORT_STRING_MAX = 255
# How RabbitMQ refuses a body above max_message_size (it closes the channel, 406) and a
# frame above frame_max (it closes the connection, 501; the numbers are payload sizes).
_BODY_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")
_FRAME_TOO_LARGE = re.compile(r"frame_too_large,\s*(\d+),\s*(\d+)")
_HEADER_PAYLOAD_PREFIX = 12  # class, weight and body size, ahead of the properties
_RECONNECT = Backoff(initial=0.1, maximum=2.0)  # between connection attempts


class SpecSource(Protocol):
    """Anything that can read a stream's spec (``producer.registry.Registry`` does, from etcd)."""

    def read_spec(self, stream: str) -> StreamSpec: ...


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a confirmed publish resolves to."""

    message_id: str
    partition: int


class _Encoded(pika.BasicProperties):  # type: ignore[misc]
    """Properties encoded already (``encoded_properties``): pika sends the bytes as they are.

    The SDK reads only ``message_id``; pika's header frame only calls :meth:`encode`.
    """

    def __init__(self, message_id: str, encoded: bytes) -> None:  # no other field is read
        self.message_id = message_id
        self._encoded = encoded

    def encode(self) -> list[bytes]:
        return [self._encoded]  # a new list each time: pika inserts into it


@dataclass(slots=True)
class _Pending:
    partition: int
    body: bytes
    properties: pika.BasicProperties
    future: Future[Receipt]
    properties_size: int  # encoded
    published_at: float = 0.0
    returned: bool = field(default=False)


class Producer:
    """Publish keyed messages to a partq stream.

    >>> with Producer("orders") as producer:          # doctest: +SKIP
    ...     producer.publish("user-1", b"hello").result()

    Without ``amqp_url`` or ``etcd`` it finds RabbitMQ and etcd the way the ``partq``
    command does: ``PARTQ_*`` environment variables, then the TOML file named by
    ``PARTQ_CONFIG``, then the defaults (both on 127.0.0.1).
    """

    def __init__(
        self,
        stream: str | StreamSpec,
        *,
        amqp_url: AmqpURL | None = None,
        etcd: SpecSource | None = None,
        partitions: int | None = None,
        window: int = 1000,
        connect_timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        name: str = "partq-producer",
    ) -> None:
        settings = None
        if amqp_url is None or (etcd is None and not isinstance(stream, StreamSpec)):
            settings = Settings.load()  # as the CLI: PARTQ_* environment > PARTQ_CONFIG file
        if isinstance(stream, StreamSpec):
            spec = stream
        else:
            validate_stream_name(stream)
            if etcd is None:
                assert settings is not None
                spec = read_spec_from_settings(stream, settings)
            else:
                spec = etcd.read_spec(stream)
        if amqp_url is None:
            assert settings is not None
            amqp_url = settings.amqp
        spec.check_partitions(partitions)
        if window < 1:
            raise UsageError(f"window must be at least 1, got {window}")
        check_partition_queues(amqp_url, spec, name=f"{name}-check")  # no queues beyond P
        self.spec = spec
        self._url = amqp_url
        self._nodes = Nodes.of(amqp_url, name=name, socket_timeout=connect_timeout)
        self._open_errors: list[str] = []  # the first connection's, one per node tried
        self._recycled_at = 0.0  # when a nack last made us reconnect
        self._reconnect_timeout = reconnect_timeout
        self._window = window
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # nothing outstanding
        self._space = threading.Condition(self._lock)  # fewer than window outstanding
        self._outbox: deque[_Pending] = deque()
        self._unconfirmed: dict[int, _Pending] = {}
        self._outstanding = 0
        self._tag = 0
        self._wake_scheduled = False
        self._closing = False
        self._connection: SelectConnection | None = None
        self._channel: Channel | None = None
        self._ready = threading.Event()
        self._first_error: BaseException | None = None
        self._connected_once = False
        self._crashed: BaseException | None = None  # what ended the I/O thread, if it failed
        # Encoded properties larger than this do not fit one header frame (the negotiated
        # frame_max replaces the requested one on connect); bodies larger than _max_body
        # are refused by the broker (it tells its max_message_size when it refuses one).
        self._max_properties = self._nodes.current.frame_max - _HEADER_FRAME_OVERHEAD
        self._max_body = sys.maxsize
        self._labels = (spec.name,)
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()
        # labelled children looked up once: .labels() costs a lock and a dict per call
        self._m_published = metrics.PUBLISHED.labels(spec.name)
        self._m_confirmed = metrics.CONFIRMED.labels(spec.name)
        self._m_confirm_seconds = metrics.CONFIRM_SECONDS.labels(spec.name)
        self._m_in_flight = metrics.IN_FLIGHT.labels(spec.name)
        self._io = threading.Thread(target=self._run, name=f"{name}-io", daemon=True)
        self._io.start()
        if not self._ready.wait(connect_timeout + 1) or self._first_error is not None:
            self._closing = True
            self._wake()
            raise self._first_error or BrokerUnavailable(
                f"no connection to RabbitMQ within {connect_timeout:.0f}s"
            )

    # -- the public surface -------------------------------------------------------------

    def publish(
        self,
        key: str | bytes,
        body: bytes | str,
        *,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
    ) -> Future[Receipt]:
        """Queue one message; the future resolves when the broker confirms it.

        Blocks while ``window`` messages are unconfirmed. Raises ``TypeError`` for
        a key that is not ``str``/``bytes``, :class:`UsageError` for a message AMQP
        cannot carry (a header value other than str, bytes, bool, a 64-bit int,
        ``Decimal``, ``datetime``, None or a dict/list of those; a ``message_id`` or
        header name over 255 bytes; a key and headers too large for one frame) and
        :class:`ProducerClosed` after close. The future fails with
        :class:`PublishFailed` if the broker refuses the message (e.g. a body above
        its ``max_message_size``). It cannot be cancelled: the message may already
        be on the wire.
        """
        partition = self.spec.partition_for(key)
        if isinstance(body, str):
            body = body.encode("utf-8")
        elif not isinstance(body, bytes | bytearray | memoryview):
            raise TypeError(f"body must be bytes or str, not {type(body).__name__}")
        if message_id is None:
            # Producer prefix + counter: unique, and unlike uuid4() no os.urandom call, which
            # drops the GIL and then waits for the busy I/O thread to hand it back.
            message_id = f"{self._id_prefix}{next(self._ids):016x}"
        now = time.time()
        encoded = None if headers else encoded_properties(key, partition, message_id, now)
        properties: pika.BasicProperties
        if encoded is not None and len(encoded) <= self._max_properties:
            properties, size = _Encoded(message_id, encoded), len(encoded)
        else:  # pika's own encoder: user headers, or a message it refuses with a reason
            properties = message_properties(
                key, partition, message_id=message_id, headers=headers, now=now
            )
            size = len(_encode_properties(properties, self._max_properties))
        body = bytes(body)
        future = PublishFuture[Receipt]()
        if len(body) > self._max_body:  # the broker refused one this large: do not send it
            metrics.FAILED.labels(*self._labels, "refused").inc()
            future.set_exception(_body_refused(len(body), self._max_body))
            return future
        pending = _Pending(partition, body, properties, future, size)
        with self._lock:  # one lock per message: the window is counted under it too
            while self._outstanding >= self._window and not self._closing:
                self._space.wait()
            if self._closing:
                raise self._closed_error()
            self._outbox.append(pending)
            self._outstanding += 1
            wake = not self._wake_scheduled and self._connection is not None
        if wake:
            self._wake()
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message published so far is confirmed or failed."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._outstanding == 0, timeout):
                raise TimeoutError(
                    f"{self._outstanding} messages still unconfirmed after {timeout}s"
                )

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, then close the connection; what is still pending then fails."""
        if self._closing and not self._io.is_alive():
            return
        try:
            self.flush(timeout)
        except TimeoutError:
            log.warning("closing with %d messages unconfirmed", self._outstanding)
        with self._lock:
            self._closing = True
            self._space.notify_all()  # publishers blocked on a full window: ProducerClosed
        self._wake()
        self._io.join(timeout=10)
        self._fail_all(ProducerClosed("the producer was closed before the broker confirmed"))

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Producer(stream={self.spec.name!r}, partitions={self.spec.partitions})"

    # -- resolution (I/O thread, or the closing thread once the I/O thread is gone) ---------

    def _resolve(
        self, outcomes: list[tuple[_Pending, PublishFailed | ProducerClosed | None]]
    ) -> None:
        """Settle each message's future, then open the window by as many (one lock, not N)."""
        if not outcomes:
            return
        now = time.monotonic()
        confirmed = 0
        for pending, error in outcomes:
            if error is None:
                confirmed += 1
                self._m_confirm_seconds.observe(now - pending.published_at)
                pending.future.set_result(Receipt(pending.properties.message_id, pending.partition))
            else:
                reasons: dict[type[Exception], str] = {
                    MessageNacked: "nacked",
                    MessageUnroutable: "unroutable",
                    ConnectionLost: "connection",
                    PublishFailed: "refused",
                }
                reason = reasons.get(type(error), "closed")
                metrics.FAILED.labels(*self._labels, reason).inc()
                pending.future.set_exception(error)
        if confirmed:
            self._m_confirmed.inc(confirmed)
        with self._lock:
            self._outstanding -= len(outcomes)
            self._m_in_flight.set(self._outstanding)  # here and per batch sent: not per message
            self._space.notify(len(outcomes))
            if self._outstanding == 0:
                self._idle.notify_all()

    def _fail_all(self, error: PublishFailed | ProducerClosed) -> None:
        with self._lock:
            doomed = [*self._unconfirmed.values(), *self._outbox]
            self._unconfirmed.clear()
            self._outbox.clear()
        self._resolve([(pending, error) for pending in doomed])

    def _refuse(
        self, refused: Callable[[_Pending], bool], error: Callable[[_Pending], PublishFailed]
    ) -> None:
        """Fail the messages the broker will never take, so that no reconnect sends them again.

        The others stay where they are: unconfirmed ones are republished in order.
        """
        with self._lock:
            tags = [tag for tag, pending in self._unconfirmed.items() if refused(pending)]
            doomed = [self._unconfirmed.pop(tag) for tag in tags]
            if any(refused(pending) for pending in self._outbox):
                kept = [pending for pending in self._outbox if not refused(pending)]
                doomed += [pending for pending in self._outbox if refused(pending)]
                self._outbox.clear()
                self._outbox.extend(kept)
        outcomes: list[tuple[_Pending, PublishFailed | ProducerClosed | None]] = [
            (pending, error(pending)) for pending in doomed
        ]
        if outcomes:
            log.warning("%d message(s) failed: %s", len(outcomes), outcomes[0][1])
        self._resolve(outcomes)

    def _closed_error(self) -> ProducerClosed:
        crashed = self._crashed
        if crashed is None:
            return ProducerClosed("the producer is closed: create a new one")
        error = ProducerClosed(
            f"the producer's I/O thread failed ({crashed!r}), so the producer is closed and "
            f"the message was not confirmed: create a new producer"
        )
        error.__cause__ = crashed
        return error

    def _crash(self, error: BaseException) -> None:
        """The I/O thread failed: fail every pending publish and refuse later ones, now."""
        with self._lock:
            if self._crashed is not None:
                return
            self._crashed = error
            self._closing = True
            self._connection = None
            self._channel = None
            self._space.notify_all()  # publishers blocked on a full window: ProducerClosed
        log.error("the producer's I/O thread failed: %r", error, exc_info=error)
        closed = self._closed_error()
        if not self._ready.is_set():  # __init__ is still waiting for the first connection
            self._first_error = closed
            self._ready.set()
        self._fail_all(closed)

    # -- the I/O thread --------------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            connection = self._connection
            if connection is None or self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            connection.ioloop.add_callback_threadsafe(self._drain)
        except Exception:  # the loop is closing; the reconnect path drains the outbox
            with self._lock:
                self._wake_scheduled = False

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here or in pika: nobody may wait on a dead thread
            self._crash(e)

    def _loop(self) -> None:
        lost_since: float | None = None
        delays = _RECONNECT.delays()
        while True:
            self._connect_once()
            with self._lock:
                self._connection = None
                self._channel = None
                self._wake_scheduled = False
                # Unconfirmed messages go back to the front, in publish order.
                requeue = [self._unconfirmed[tag] for tag in sorted(self._unconfirmed)]
                self._unconfirmed.clear()
                self._outbox.extendleft(reversed(requeue))
                closing = self._closing
            if closing:
                return
            if self._first_error is not None:
                return  # the first connection failed: __init__ reports it
            now = time.monotonic()
            lost_since = lost_since or now
            if now - lost_since > self._reconnect_timeout:
                self._fail_all(
                    ConnectionLost(
                        f"no connection to RabbitMQ at {self._nodes.where} "
                        f"for {self._reconnect_timeout:.0f}s; the message was not confirmed"
                    )
                )
                lost_since = None
            time.sleep(delays.next())
            if self._connected_once:
                lost_since = None
                delays.reset()

    def _connect_once(self) -> None:
        self._connected_once = False
        connection = SelectConnection(
            self._nodes.current,
            on_open_callback=self._on_connection_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_connection_closed,
        )
        try:
            connection.ioloop.start()
        except BaseException as e:
            self._crash(e)  # first, so that no publisher waits for the cleanup
            self._abandon(connection)
            raise
        finally:
            connection.ioloop.close()  # its wake-up socket pair would leak otherwise

    @staticmethod
    def _abandon(connection: SelectConnection) -> None:
        """After the loop failed: close the connection politely, in at most two seconds."""
        with contextlib.suppress(Exception):
            if connection.is_closed:
                return
            connection.ioloop.call_later(2.0, connection.ioloop.stop)
            if not connection.is_closing:
                connection.close()  # _on_connection_closed stops the loop once it is closed
            connection.ioloop.start()

    def _on_open_error(self, connection: SelectConnection, error: BaseException) -> None:
        failed = unavailable(self._nodes.where, error)
        self._nodes.advance()
        if not self._ready.is_set():
            self._open_errors.append(str(failed))
            if len(self._open_errors) >= len(self._nodes.params):  # every node, once
                self._first_error = (
                    failed
                    if len(self._open_errors) == 1
                    else BrokerUnavailable(
                        f"no RabbitMQ node of the list answered: {'; '.join(self._open_errors)}"
                    )
                )
                self._ready.set()
        else:
            log.warning("reconnect to RabbitMQ failed: %s; trying %s", failed, self._nodes.where)
        connection.ioloop.stop()

    def _on_connection_open(self, connection: SelectConnection) -> None:
        # a list's node, or a reconnect, is news; a single URL's first connection is not
        news = len(self._nodes.params) > 1 or self._ready.is_set()
        log.log(
            logging.INFO if news else logging.DEBUG,
            "connected to RabbitMQ at %s",
            self._nodes.where,
        )
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_connection_closed(self, connection: SelectConnection, reason: BaseException) -> None:
        if isinstance(reason, pika.exceptions.ConnectionClosedByBroker):
            found = _FRAME_TOO_LARGE.search(str(reason.reply_text))
            if found is not None:  # a header frame above frame_max: reconnecting cannot help
                limit = int(found.group(2)) - _HEADER_PAYLOAD_PREFIX
                self._refuse(
                    lambda pending: pending.properties_size > limit,
                    lambda pending: _frame_refused(pending.properties_size, limit),
                )
        if not self._closing:
            self._nodes.advance()
            log.warning(
                "lost the RabbitMQ connection: %s; reconnecting to %s", reason, self._nodes.where
            )
        connection.ioloop.stop()

    def _on_channel_open(self, channel: Channel) -> None:
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm)
        self._max_properties = channel.connection.params.frame_max - _HEADER_FRAME_OVERHEAD
        with self._lock:
            self._connection = channel.connection
            self._channel = channel
            self._tag = 0
            self._wake_scheduled = False
        self._connected_once = True
        self._ready.set()
        self._drain()

    def _on_channel_closed(self, channel: Channel, reason: BaseException) -> None:
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            self._on_refusal(reason.reply_code, str(reason.reply_text))
        connection = channel.connection
        if connection.is_open:
            connection.close()

    def _on_refusal(self, code: int, text: str) -> None:
        """The broker closed the channel: fail what republishing cannot help."""
        too_large = _BODY_TOO_LARGE.search(text)
        if code == 404:  # the exchange is gone
            self._fail_all(
                ConnectionLost(
                    f"exchange {self.spec.exchange} does not exist ({text}): "
                    f"create the stream with `partq stream create {self.spec.name}`"
                )
            )
        elif too_large is not None:
            # A body above the broker's max_message_size: that message alone fails (the
            # others are republished), and later ones as large fail in publish(), unsent.
            limit = int(too_large.group(2))
            self._max_body = limit
            self._refuse(
                lambda pending: len(pending.body) > limit,
                lambda pending: _body_refused(len(pending.body), limit),
            )

    def _drain(self) -> None:
        with self._lock:
            self._wake_scheduled = False
            channel = self._channel
            if self._closing and not self._outbox and not self._unconfirmed:
                if self._connection is not None and self._connection.is_open:
                    self._connection.close()
                return
            if channel is None or not channel.is_open:
                return
            batch = list(self._outbox)
            self._outbox.clear()
            self._m_in_flight.set(self._outstanding)
            # Tagged before publishing: one lock for the batch, and a publish cut short
            # by a lost channel is already in _unconfirmed, so it is republished.
            for pending in batch:
                self._tag += 1
                self._unconfirmed[self._tag] = pending
        exchange = self.spec.exchange
        now = time.monotonic()
        for pending in batch:
            pending.published_at = now
            channel.basic_publish(
                exchange,
                str(pending.partition),
                pending.body,
                pending.properties,
                mandatory=True,
            )
        if batch:
            self._m_published.inc(len(batch))

    def _on_return(
        self,
        channel: Channel,
        method: pika.spec.Basic.Return,
        properties: pika.BasicProperties,
        body: bytes,
    ) -> None:
        # A mandatory message that no queue took comes back before its ack.
        with self._lock:
            for pending in self._unconfirmed.values():
                if not pending.returned and pending.properties.message_id == properties.message_id:
                    pending.returned = True
                    break

    def _on_confirm(self, frame: pika.frame.Method) -> None:
        method = frame.method
        nacked = isinstance(method, pika.spec.Basic.Nack)
        with self._lock:
            if method.multiple:
                tags = []
                for tag in self._unconfirmed:  # ascending: tags are inserted in order
                    if tag > method.delivery_tag:
                        break
                    tags.append(tag)
            else:
                tags = [method.delivery_tag] if method.delivery_tag in self._unconfirmed else []
            done = [self._unconfirmed.pop(tag) for tag in tags]
        outcomes: list[tuple[_Pending, PublishFailed | ProducerClosed | None]] = []
        for pending in done:
            error: PublishFailed | None = None
            if nacked:
                error = MessageNacked("the broker refused the message (nack)")
            elif pending.returned:
                error = MessageUnroutable(
                    f"no queue is bound for partition {pending.partition} of "
                    f"{self.spec.name!r}: run `partq stream create {self.spec.name} "
                    f"--partitions {self.spec.partitions}` to declare its queues"
                )
            outcomes.append((pending, error))
        self._resolve(outcomes)  # all at once: one lock and one window release per confirm
        if nacked and not self._closing:
            self._recycle_after_nack()
        if self._closing:
            self._drain()

    def _recycle_after_nack(self) -> None:
        """A nack: start over on a new connection (the next node of a list), at most once
        per ``_NACK_RECYCLE`` seconds. RabbitMQ 3.10 keeps nacking every publish on a channel
        whose quorum-queue leader died, though the queue has a new leader (measured:
        60 s of nacks on the old channel; a new channel confirms after 1 s)."""
        now = time.monotonic()
        if now - self._recycled_at < _NACK_RECYCLE:
            return
        self._recycled_at = now
        log.warning("the broker nacked a publish: reconnecting (to %s)", self._nodes.where)
        channel = self._channel
        if channel is not None and channel.is_open:
            channel.close()  # -> _on_channel_closed -> the connection closes, then reconnects


# -- what AMQP can carry (the caller's thread; the slow paths only run for a bad message) ----


def _encode_properties(properties: Any, limit: int) -> bytes:
    """``properties`` encoded as pika sends them, once: pika then sends these bytes as they are.

    Raises :class:`UsageError` for what pika cannot encode, or for more than ``limit`` bytes
    (what one header frame carries): in the I/O thread the first would end the thread and
    the second would make the broker close the connection, again at every republish.
    """
    try:
        encoded = b"".join(properties.encode())
    except Exception as e:  # struct.error, pika's own, AssertionError, UnicodeEncodeError …
        raise UsageError(f"cannot publish this message: {_unencodable(properties, e)}") from None
    if len(encoded) > limit:
        raise UsageError(
            f"cannot publish this message: its key (sent as a header), headers and message_id "
            f"take {len(encoded)} bytes encoded, more than the {limit} that fit one AMQP frame "
            f"with this connection's frame_max of {limit + _HEADER_FRAME_OVERHEAD}: use a shorter "
            f"key (e.g. a hash of a long id) or carry large values in the body"
        )
    # pika's header frame calls encode() and inserts into the list it gets: a new one each time
    properties.encode = [encoded].copy
    return encoded


def _body_refused(size: int, limit: int) -> PublishFailed:
    return PublishFailed(
        f"the broker refused the message: its body of {size} bytes is above the broker's "
        f"max_message_size of {limit} bytes: split it, or raise max_message_size in "
        f"rabbitmq.conf"
    )


def _frame_refused(size: int, limit: int) -> PublishFailed:
    return PublishFailed(
        f"the broker refused the message: its key (sent as a header), headers and message_id "
        f"take {size} bytes encoded, more than the {limit} that fit one AMQP frame with the "
        f"broker's frame_max of {limit + _HEADER_FRAME_OVERHEAD} (frame too large): use a "
        f"shorter key or carry large values in the body"
    )


def _unencodable(properties: Any, error: Exception) -> str:
    """Why pika could not encode ``properties``: which field, what is wrong, what to do."""
    message_id = properties.message_id
    problem = _short_string_problem(f"message_id {_short(message_id)}", message_id)
    if problem is None and properties.headers is not None:
        problem = _table_problem(properties.headers, "")
    return problem or f"pika cannot encode its properties ({type(error).__name__}: {error})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}…"


def _short_string_problem(what: str, value: Any) -> str | None:
    """What is wrong with ``value`` (described as ``what``) as an AMQP short string, if anything."""
    if value is None:
        return None
    if not isinstance(value, str | bytes):
        return f"{what} must be a str, not {type(value).__name__}"
    try:
        size = len(value.encode("utf-8")) if isinstance(value, str) else len(value)
    except UnicodeEncodeError:
        return f"{what} is not valid UTF-8 text (it holds a lone surrogate)"
    if size > _SHORT_STRING_MAX:
        return (
            f"{what} is {size} bytes in UTF-8, more than the {_SHORT_STRING_MAX} an AMQP "
            f"short string holds: make it shorter"
        )
    return None


def _table_problem(table: Mapping[Any, Any], path: str) -> str | None:
    for name, value in table.items():
        what = f"header {path} has key {_short(name)}" if path else f"header key {_short(name)}"
        problem = _short_string_problem(what, name)
        if problem is None:
            problem = _value_problem(value, f"{path}[{name!r}]" if path else repr(name))
        if problem is not None:
            return problem
    return None


def _value_problem(value: Any, path: str) -> str | None:
    if isinstance(value, dict):
        return _table_problem(value, path)
    if isinstance(value, list):
        for index, item in enumerate(value):
            problem = _value_problem(item, f"{path}[{index}]")
            if problem is not None:
                return problem
        return None
    try:
        pika.data.encode_value([], value)
        return None
    except Exception:
        pass
    what = f"header {path}"
    kind = type(value).__name__
    if isinstance(value, str):
        return f"{what} is not valid UTF-8 text (it holds a lone surrogate): fix it, or send bytes"
    if isinstance(value, int):
        return (
            f"{what} is {value}, outside AMQP's signed 64-bit integers "
            f"(-2**63 … 2**63-1): send it as a str"
        )
    if isinstance(value, float):
        return f"{what} is a float ({value!r}), which pika cannot send: send a str or a Decimal"
    if isinstance(value, Decimal):
        return (
            f"{what} is Decimal({str(value)!r}), which an AMQP decimal cannot hold (a finite "
            f"signed 32-bit integer scaled by at most 255 decimal places): send it as a str"
        )
    if isinstance(value, datetime):
        return (
            f"{what} is {value.isoformat()}: AMQP timestamps are whole seconds from 1970 on "
            f"(unsigned 64-bit): send it as a str"
        )
    if isinstance(value, tuple | set | frozenset):
        return f"{what} is a {kind}: an AMQP array is a list: send list(...)"
    if isinstance(value, bytearray | memoryview):
        return f"{what} is a {kind}: send bytes(...)"
    return (
        f"{what} is a {kind}, which an AMQP header cannot carry: use str, bytes, bool, int, "
        f"Decimal, datetime, None, or a dict or list of those"
    )
