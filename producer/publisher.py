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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from producer import metrics
from producer.amqp import (
    DEFAULT_AMQP_URL,
    check_partition_queues,
    connection_parameters,
    message_properties,
    unavailable,
)
from producer.contract import StreamSpec, validate_stream_name
from producer.errors import (
    BrokerUnavailable,
    ConnectionLost,
    MessageNacked,
    MessageUnroutable,
    ProducerClosed,
    PublishFailed,
    UsageError,
)

__all__ = ["Producer", "Receipt", "SpecSource"]

log = logging.getLogger("partq.producer")


class SpecSource(Protocol):
    """Anything that can read a stream's spec (``coordinator.Registry`` does, from etcd)."""

    def read_spec(self, stream: str) -> StreamSpec: ...


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a confirmed publish resolves to."""

    message_id: str
    partition: int


class _PublishFuture(Future[Receipt]):
    """A publish cannot be taken back once handed over, so its future cannot be cancelled.

    (Cheaper than ``set_running_or_notify_cancel()``, which takes the future's lock.)
    """

    def cancel(self) -> bool:
        return False


@dataclass(slots=True)
class _Pending:
    partition: int
    body: bytes
    properties: pika.BasicProperties
    future: Future[Receipt]
    published_at: float = 0.0
    returned: bool = field(default=False)


class Producer:
    """Publish keyed messages to a partq stream.

    >>> with Producer("orders", etcd=registry) as producer:          # doctest: +SKIP
    ...     producer.publish("user-1", b"hello").result()
    """

    def __init__(
        self,
        stream: str | StreamSpec,
        *,
        amqp_url: str = DEFAULT_AMQP_URL,
        etcd: SpecSource | None = None,
        partitions: int | None = None,
        window: int = 1000,
        connect_timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        name: str = "partq-producer",
    ) -> None:
        if isinstance(stream, StreamSpec):
            spec = stream
        else:
            validate_stream_name(stream)
            if etcd is None:
                raise UsageError(
                    f"Producer({stream!r}) needs etcd= (e.g. coordinator.Registry) to read the "
                    f"stream's spec, or pass a StreamSpec"
                )
            spec = etcd.read_spec(stream)
        spec.check_partitions(partitions)
        if window < 1:
            raise UsageError(f"window must be at least 1, got {window}")
        check_partition_queues(amqp_url, spec, name=f"{name}-check")  # no queues beyond P
        self.spec = spec
        self._url = amqp_url
        self._params = connection_parameters(amqp_url, name=name)
        self._params.connection_attempts = 1
        self._params.socket_timeout = connect_timeout
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
        a key that is not ``str``/``bytes`` and :class:`ProducerClosed` after close.
        The future cannot be cancelled: the message may already be on the wire.
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
        properties = message_properties(key, partition, message_id=message_id, headers=headers)
        future = _PublishFuture()
        pending = _Pending(partition, bytes(body), properties, future)
        with self._lock:  # one lock per message: the window is counted under it too
            while self._outstanding >= self._window and not self._closing:
                self._space.wait()
            if self._closing:
                raise ProducerClosed("the producer is closed: create a new one")
            self._outbox.append(pending)
            self._outstanding += 1
            self._m_in_flight.inc()
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
                }
                reason = reasons.get(type(error), "closed")
                metrics.FAILED.labels(*self._labels, reason).inc()
                pending.future.set_exception(error)
        if confirmed:
            self._m_confirmed.inc(confirmed)
        self._m_in_flight.dec(len(outcomes))
        with self._lock:
            self._outstanding -= len(outcomes)
            self._space.notify(len(outcomes))
            if self._outstanding == 0:
                self._idle.notify_all()

    def _fail_all(self, error: PublishFailed | ProducerClosed) -> None:
        with self._lock:
            doomed = [*self._unconfirmed.values(), *self._outbox]
            self._unconfirmed.clear()
            self._outbox.clear()
        self._resolve([(pending, error) for pending in doomed])

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
        lost_since: float | None = None
        backoff = 0.1
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
                        f"no connection to RabbitMQ at {self._params.host}:{self._params.port} "
                        f"for {self._reconnect_timeout:.0f}s; the message was not confirmed"
                    )
                )
                lost_since = None
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
            if self._connected_once:
                lost_since, backoff = None, 0.1

    def _connect_once(self) -> None:
        self._connected_once = False
        connection = SelectConnection(
            self._params,
            on_open_callback=self._on_connection_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_connection_closed,
        )
        try:
            connection.ioloop.start()
        finally:
            connection.ioloop.close()  # its wake-up socket pair would leak otherwise

    def _on_open_error(self, connection: SelectConnection, error: BaseException) -> None:
        if not self._ready.is_set():
            self._first_error = unavailable(self._url, error)
            self._ready.set()
        else:
            log.warning("reconnect to RabbitMQ failed: %r", error)
        connection.ioloop.stop()

    def _on_connection_open(self, connection: SelectConnection) -> None:
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_connection_closed(self, connection: SelectConnection, reason: BaseException) -> None:
        if not self._closing:
            log.warning("lost the RabbitMQ connection: %s; reconnecting", reason)
        connection.ioloop.stop()

    def _on_channel_open(self, channel: Channel) -> None:
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm)
        with self._lock:
            self._connection = channel.connection
            self._channel = channel
            self._tag = 0
            self._wake_scheduled = False
        self._connected_once = True
        self._ready.set()
        self._drain()

    def _on_channel_closed(self, channel: Channel, reason: BaseException) -> None:
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker) and reason.reply_code == 404:
            # The exchange is gone: republishing cannot help.
            self._fail_all(
                ConnectionLost(
                    f"exchange {self.spec.exchange} does not exist ({reason.reply_text}): "
                    f"create the stream with `partq stream create {self.spec.name}`"
                )
            )
        connection = channel.connection
        if connection.is_open:
            connection.close()

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
        if self._closing:
            self._drain()
