"""The producer SDK: keyed, persistent, confirmed publishes with a bounded window.

One I/O thread owns a pika ``SelectConnection``; callers from any thread hand
it messages through an outbox and get a ``Future`` back (``publish`` one,
``publish_many`` a batch: one lock and one wake-up of the I/O thread for the batch).
Confirms are pipelined: up to ``window`` messages are unconfirmed at once, and
``publish`` blocks when the window is full (backpressure), so memory stays bounded.
The I/O thread frames messages itself (:class:`partq.producer.wire.Framer`) and settles a
confirm frame's futures, counters and histogram in one go.

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

Threads. The I/O thread (``<name>-io``) owns the connection, its channel and ``Framer``,
and the delivery tags. Callers of ``publish``/``publish_many`` (any thread) encode in
their own thread, append to ``_outbox`` under ``_lock`` and wake the I/O thread with one
``add_callback_threadsafe(_drain)`` per burst (``_wake_scheduled``). ``_lock`` also guards
``_unconfirmed``, ``_outstanding`` and the connection references; ``_space`` and ``_idle``,
conditions on it, block publishers on a full window and ``flush`` until nothing is left.
Futures are settled outside the lock: on the I/O thread (confirms, refusals), on the
caller's thread (a body already known too large, a batch cut short by a close) and on
the closing thread (what ``close`` fails). ``_max_body`` and ``_max_properties``, written
by the I/O thread, and ``_closing`` are read without the lock (one value each; a stale
limit only means the broker refuses the message).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import re
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import pika
import pika.exceptions
from partq.producer import metrics
from partq.producer.contract import StreamSpec, refuse_control_headers, validate_stream_name
from partq.producer.follow import SpecFollower, SpecWatcher, resizing_to
from partq.producer.futures import PublishFuture, resolve_all
from partq.producer.layout import Layout
from partq.producer.registry import Registry
from partq.producer.topology import check_partition_queues, encoded_properties, message_properties
from partq.producer.wire import (
    HEADER_FRAME_OVERHEAD,
    ConfirmingConnection,
    Framer,
    body_refused,
    encode_properties,
    frame_refused,
)
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL, Nodes, unavailable
from partq.kernel.backoff import Backoff
from partq.kernel.errors import (
    BrokerUnavailable,
    ConnectionLost,
    MessageNacked,
    MessageUnroutable,
    ProducerClosed,
    PublishFailed,
    UsageError,
)
from partq.kernel.settings import Settings

__all__ = ["BatchItem", "Producer", "Receipt", "SpecSource"]

log = logging.getLogger("partq.producer")

_NACK_RECYCLE = 5.0  # seconds between reconnects caused by nacks
# How RabbitMQ refuses a body above max_message_size (it closes the channel, 406) and a
# frame above frame_max (it closes the connection, 501; the numbers are payload sizes).
_BODY_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")
_FRAME_TOO_LARGE = re.compile(r"frame_too_large,\s*(\d+),\s*(\d+)")
_HEADER_PAYLOAD_PREFIX = 12  # class, weight and body size, ahead of the properties
_RECONNECT = Backoff(initial=0.1, maximum=2.0)  # between connection attempts
_FAILED_REASONS: dict[type[Exception], str] = {  # the reason label of metrics.FAILED
    MessageNacked: "nacked",
    MessageUnroutable: "unroutable",
    ConnectionLost: "connection",
    PublishFailed: "refused",
}
# What publish_many takes: (key, body), (key, body, headers) or (key, body, headers, message_id)
BatchItem = (
    tuple[str | bytes, bytes | str]
    | tuple[str | bytes, bytes | str, Mapping[str, Any] | None]
    | tuple[str | bytes, bytes | str, Mapping[str, Any] | None, str | None]
)


class SpecSource(Protocol):
    """Anything that can read a stream's spec (``partq.producer.registry.Registry`` does, from
    etcd)."""

    def read_spec(self, stream: str) -> StreamSpec: ...


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a confirmed publish resolves to."""

    message_id: str
    partition: int


@dataclass(slots=True)
class _Pending:
    partition: int
    body: bytes
    properties: bytes  # the content header's properties, encoded
    message_id: str
    future: PublishFuture[Receipt]
    # what a republish under a newer layout encodes again (the partition header changes)
    key: str | bytes
    headers: Mapping[str, Any] | None
    now: float  # its partq-published-ms and timestamp, kept across a republish
    epoch: int  # of the layout it was routed under
    routing_key: str
    published_at: float = 0.0
    returned: bool = False


def _unpack(
    item: BatchItem,
) -> tuple[str | bytes, bytes | str, Mapping[str, Any] | None, str | None]:
    if len(item) == 2:
        return item[0], item[1], None, None
    if len(item) == 3:
        return item[0], item[1], item[2], None
    if len(item) == 4:
        return item
    raise TypeError(
        f"publish_many takes (key, body), (key, body, headers) or (key, body, headers, "
        f"message_id) tuples, not {len(item)} items"
    )


def _spec_and_url(
    stream: str | StreamSpec, amqp_url: AmqpURL | None, etcd: SpecSource | None
) -> tuple[StreamSpec, AmqpURL, SpecSource | None, Registry | None]:
    """The spec and the broker of a producer: as given, else read as the CLI reads them
    (PARTQ_* environment > PARTQ_CONFIG file, the spec from etcd); the spec's source (to
    follow resizes) and the registry made here, if one was (the producer closes it)."""
    settings = None
    if amqp_url is None or (etcd is None and not isinstance(stream, StreamSpec)):
        settings = Settings.load()
    made = None
    if isinstance(stream, StreamSpec):
        spec = stream
    else:
        validate_stream_name(stream)
        if etcd is None:
            assert settings is not None
            etcd = made = Registry.connect(settings)
        try:
            spec = etcd.read_spec(stream)
        except BaseException:
            if made is not None:
                made.close()
            raise
    if amqp_url is None:
        assert settings is not None
        amqp_url = settings.amqp
    return spec, amqp_url, etcd, made


def _check(
    spec: StreamSpec,
    amqp_url: AmqpURL,
    partitions: int | None,
    window: int,
    name: str,
    source: SpecSource | None,
) -> None:
    spec.check_partitions(partitions)
    if window < 1:
        raise UsageError(f"window must be at least 1, got {window}")
    follows = _follows(source)
    check_partition_queues(  # no queues beyond P, but those of a resize that runs
        amqp_url,
        spec,
        name=f"{name}-check",
        resizing_to=None if follows is None else functools.partial(resizing_to, follows, spec.name),
    )


def _follows(source: SpecSource | None) -> SpecWatcher | None:
    """``source`` if it can watch the spec (a :class:`Registry` can; a plain reader not)."""
    needed = ("watch_spec", "cancel_watch", "read_resize")
    if source is not None and all(callable(getattr(source, n, None)) for n in needed):
        return source  # type: ignore[return-value]
    return None


class Producer:
    """Publish keyed messages to a partq stream.

    >>> with Producer("orders") as producer:          # doctest: +SKIP
    ...     producer.publish("user-1", b"hello").result()

    Without ``amqp_url`` or ``etcd`` it finds RabbitMQ and etcd the way the ``partq``
    command does: ``PARTQ_*`` environment variables, then the TOML file named by
    ``PARTQ_CONFIG``, then the defaults (both on 127.0.0.1).

    It follows the stream's layout (docs/resize.md) when it reads the spec from etcd: a
    watch moves new publishes to a resized layout, and a message the broker returns
    because its layout was cut stops the stream's publishing until etcd has a newer
    layout (at most ``layout_timeout`` seconds, else it fails with
    :class:`MessageUnroutable`); it is then republished under the new layout, with every
    later message, in the order they were published. A producer given a
    :class:`StreamSpec` without ``etcd`` does not follow: a return fails its message.

    ``on_settled``, if given, is called with the futures that just settled (confirmed or
    failed), each future once, on whichever thread settled them (mostly the I/O thread,
    once per confirm frame); it must be quick and must not raise. It lets a bridge such
    as :class:`producer.AsyncProducer` follow every future without a callback on each.
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
        on_settled: Callable[[Sequence[PublishFuture[Receipt]]], None] | None = None,
        layout_timeout: float = 30.0,
    ) -> None:
        spec, amqp_url, source, self._registry = _spec_and_url(stream, amqp_url, etcd)
        try:
            _check(spec, amqp_url, partitions, window, name, source)
        except BaseException:
            self._close_registry()
            raise
        self.spec = spec
        self._follow_layouts(spec, layout_timeout)
        self._url = amqp_url
        self._nodes = Nodes.of(amqp_url, name=name, socket_timeout=connect_timeout)
        self._open_errors: list[str] = []  # the first connection's, one per node tried
        self._recycled_at = 0.0  # when a nack last made us reconnect
        self._reconnect_timeout = reconnect_timeout
        self._window = window
        self._on_settled = on_settled
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
        self._framer: Framer | None = None  # the channel's
        self._ready = threading.Event()
        self._first_error: BaseException | None = None
        self._connected_once = False
        self._crashed: BaseException | None = None  # what ended the I/O thread, if it failed
        # Encoded properties larger than this do not fit one header frame (the negotiated
        # frame_max replaces the requested one on connect); bodies larger than _max_body
        # are refused by the broker (it tells its max_message_size when it refuses one).
        self._max_properties = self._nodes.current.frame_max - HEADER_FRAME_OVERHEAD
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
        watcher = _follows(source)
        self._follower: SpecFollower | None = (
            None if watcher is None else SpecFollower(watcher, spec, self._on_spec)
        )
        try:
            self._connect(connect_timeout)
        except BaseException:
            self._close_registry()
            raise

    def _follow_layouts(self, spec: StreamSpec, timeout: float) -> None:
        """The state of following resizes (the follower itself comes once all is set)."""
        self._layout: Layout = spec.layout  # replaced whole when a watch sees a newer epoch
        self._layout_timeout = timeout
        # Returned by the broker (their layout was cut), by delivery tag: republished in
        # order under a newer layout once every message sent before or with them is
        # settled. ``_held``: one was returned, nothing new goes out meanwhile.
        self._returned: dict[int, _Pending] = {}
        self._held = False
        self._awaiting_layout = False  # a thread waits for a newer layout in etcd
        self.rerouted = 0  # messages returned by a cut layout and republished under a newer
        self._wire_epoch = spec.epoch  # of the messages in _unconfirmed (all of one epoch)

    def _on_spec(self, spec: StreamSpec) -> None:
        """A newer layout (the watch's thread): later publishes use it."""
        self.spec = spec
        self._layout = spec.layout
        self._wake()  # messages held for the newer epoch go out

    def _close_registry(self) -> None:
        follower = getattr(self, "_follower", None)  # None until the follower is made
        if follower is not None:
            follower.close()
            self._follower = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None

    def _connect(self, timeout: float) -> None:
        """Start the I/O thread; wait for its first connection, or raise why there is none."""
        self._io.start()
        if not self._ready.wait(timeout + 1) or self._first_error is not None:
            self._closing = True
            self._wake()
            raise self._first_error or BrokerUnavailable(
                f"no connection to RabbitMQ within {timeout:.0f}s"
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
        header name over 255 bytes; a key and headers too large for one frame; partq's
        control header ``x-partq-control``) and
        :class:`ProducerClosed` after close. The future fails with
        :class:`PublishFailed` if the broker refuses the message (e.g. a body above
        its ``max_message_size``). It cannot be cancelled: the message may already
        be on the wire.
        """
        pending = self._prepare(key, body, headers, message_id, time.time())
        if len(pending.body) > self._max_body:  # the broker refused one this large: unsent
            self._refuse_unsent([pending], self._max_body)
            return pending.future
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
        return pending.future

    def publish_many(self, messages: Iterable[BatchItem]) -> list[Future[Receipt]]:
        """Queue a batch of ``(key, body)``, ``(key, body, headers)`` or ``(key, body,
        headers, message_id)`` tuples (``headers`` and ``message_id`` may be None).

        As many :meth:`publish` calls, in order, and cheaper: one lock and one wake-up
        of the I/O thread per window's worth instead of per message. Every message is
        checked before any is queued: a message ``publish`` would refuse raises here
        (``TypeError``, :class:`UsageError`) and none of the batch is sent. Each
        message then has its own future, in the batch's order: a message the broker
        refuses fails only its own. Blocks while the window is full; if the producer
        is closed before the whole batch is queued, the rest fail with
        :class:`ProducerClosed` (raised instead when nothing was queued).
        """
        return self._hand_over(self._prepare_batch(messages, time.time()))

    def _prepare_batch(self, messages: Iterable[BatchItem], now: float) -> list[_Pending]:
        """publish_many's first half: every message checked and encoded, none queued."""
        return [self._prepare(*_unpack(item), now) for item in messages]

    def _hand_over(self, batch: list[_Pending]) -> list[Future[Receipt]]:
        """publish_many's second half: queue prepared messages in order, a window at a time."""
        futures: list[Future[Receipt]] = [pending.future for pending in batch]
        limit = self._max_body
        if limit != sys.maxsize and any(len(pending.body) > limit for pending in batch):
            self._refuse_unsent([p for p in batch if len(p.body) > limit], limit)
            batch = [pending for pending in batch if len(pending.body) <= limit]
        queued, total = 0, len(batch)
        while queued < total:
            closed = None
            with self._lock:
                while self._outstanding >= self._window and not self._closing:
                    self._space.wait()
                if self._closing:
                    closed = self._closed_error()
                else:
                    take = min(total - queued, self._window - self._outstanding)
                    self._outbox.extend(batch[queued : queued + take])
                    self._outstanding += take
                    queued += take
                    wake = not self._wake_scheduled and self._connection is not None
            if closed is not None:
                if queued == 0:
                    raise closed
                for pending in batch[queued:]:
                    pending.future.set_exception(closed)
                self._settled([pending.future for pending in batch[queued:]])
                break
            if wake:
                self._wake()
        return futures

    def _refuse_unsent(self, refused: list[_Pending], limit: int) -> None:
        """Bodies above the broker's max_message_size (it refused one): fail, never sent."""
        metrics.FAILED.labels(*self._labels, "refused").inc(len(refused))
        for pending in refused:
            pending.future.set_exception(body_refused(len(pending.body), limit))
        self._settled([pending.future for pending in refused])

    def _settled(self, futures: Sequence[PublishFuture[Receipt]]) -> None:
        """Tell ``on_settled`` (a bridge such as AsyncProducer) which futures just settled."""
        if self._on_settled is not None and futures:
            self._on_settled(futures)

    def _prepare(
        self,
        key: str | bytes,
        body: bytes | str,
        headers: Mapping[str, Any] | None,
        message_id: str | None,
        now: float,
    ) -> _Pending:
        """One message, hashed and encoded in the caller's thread (its checks raise here)."""
        layout = self._layout
        partition = layout.partition_for(key)
        if isinstance(body, str):
            body = body.encode("utf-8")
        elif not isinstance(body, bytes):
            if not isinstance(body, bytearray | memoryview):
                raise TypeError(f"body must be bytes or str, not {type(body).__name__}")
            body = bytes(body)
        if message_id is None:
            # Producer prefix + counter: unique, and unlike uuid4() no os.urandom call, which
            # drops the GIL and then waits for the busy I/O thread to hand it back.
            message_id = f"{self._id_prefix}{next(self._ids):016x}"
        encoded = encoded_properties(key, partition, message_id, now, headers)
        if encoded is None or len(encoded) > self._max_properties:
            # pika's own encoder: headers it alone encodes, or a message it refuses with a
            # reason; the fast encoder leaves partq's control header to this path
            refuse_control_headers(headers)
            properties = message_properties(
                key, partition, message_id=message_id, headers=headers, now=now
            )
            encoded = encode_properties(properties, self._max_properties)
            message_id = properties.message_id  # pika's path makes one up for an empty id
        routing_key = layout.routing_key(partition)
        return _Pending(
            partition,
            body,
            encoded,
            message_id,
            PublishFuture[Receipt](),
            key,
            headers,
            now,
            layout.epoch,
            routing_key,
        )

    def _reroute(self, pending: _Pending, layout: Layout) -> None:
        """``pending`` (prepared under an older layout) routed and encoded under ``layout``:
        the I/O thread's, before it frames the message (same id, same publish time)."""
        partition = layout.partition_for(pending.key)
        encoded = encoded_properties(
            pending.key, partition, pending.message_id, pending.now, pending.headers
        )
        if encoded is None or len(encoded) > self._max_properties:
            properties = message_properties(
                pending.key,
                partition,
                message_id=pending.message_id,
                headers=pending.headers,
                now=pending.now,
            )
            encoded = encode_properties(properties, self._max_properties)
        pending.partition = partition
        pending.properties = encoded
        pending.epoch = layout.epoch
        pending.routing_key = layout.routing_key(partition)

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
        self._close_registry()

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
        self,
        confirmed: list[_Pending],
        failed: list[tuple[_Pending, PublishFailed | ProducerClosed]] | None = None,
    ) -> None:
        """Settle each message's future, then open the window by as many (one lock, not N)."""
        settled = len(confirmed)
        if confirmed:
            now = time.monotonic()
            # A drained batch shares its published_at: one histogram update per run of them.
            metrics.observe_runs(
                self._m_confirm_seconds, now, [pending.published_at for pending in confirmed]
            )
            resolve_all(
                [
                    (pending.future, Receipt(pending.message_id, pending.partition))
                    for pending in confirmed
                ]
            )
            self._m_confirmed.inc(settled)
        for pending, error in failed or ():
            settled += 1
            reason = _FAILED_REASONS.get(type(error), "closed")
            metrics.FAILED.labels(*self._labels, reason).inc()
            pending.future.set_exception(error)
        if not settled:
            return
        with self._lock:
            self._outstanding -= settled
            self._m_in_flight.set(self._outstanding)  # here and per batch sent: not per message
            self._space.notify(settled)
            if self._outstanding == 0:
                self._idle.notify_all()
        if self._on_settled is not None:  # after the window opened: the bridge may refill it
            self._settled([p.future for p in confirmed] + [p.future for p, _ in failed or ()])

    def _fail_all(self, error: PublishFailed | ProducerClosed) -> None:
        with self._lock:
            doomed = [*self._in_order(), *self._outbox]
            self._unconfirmed.clear()
            self._returned.clear()
            self._outbox.clear()
            self._held = False
        self._resolve([], [(pending, error) for pending in doomed])

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
        outcomes: list[tuple[_Pending, PublishFailed | ProducerClosed]] = [
            (pending, error(pending)) for pending in doomed
        ]
        if outcomes:
            log.warning("%d message(s) failed: %s", len(outcomes), outcomes[0][1])
        self._resolve([], outcomes)

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
            self._framer = None
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
                self._framer = None
                self._wake_scheduled = False
                # Unconfirmed and returned messages go back to the front, in publish order
                # (sent again, the returned ones are rerouted if a newer layout is known).
                requeue = self._in_order()
                self._unconfirmed.clear()
                self._returned.clear()
                self._held = False
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
        connection = ConfirmingConnection(
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
                    lambda pending: len(pending.properties) > limit,
                    lambda pending: frame_refused(len(pending.properties), limit),
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
        channel.connection.route_confirms(channel.channel_number, self._on_confirm)
        self._max_properties = channel.connection.params.frame_max - HEADER_FRAME_OVERHEAD
        with self._lock:
            self._connection = channel.connection
            self._channel = channel
            self._framer = Framer(channel.connection, channel.channel_number, self.spec.exchange)
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
                lambda pending: body_refused(len(pending.body), limit),
            )

    def _in_order(self) -> list[_Pending]:
        """Unconfirmed and returned messages, in the order they were sent (under the lock)."""
        sent = {**self._unconfirmed, **self._returned}
        return [sent[tag] for tag in sorted(sent)]

    def _drain(self) -> None:
        with self._lock:
            self._wake_scheduled = False
            channel = self._channel
            if self._closing and not self._outbox and not self._unconfirmed and not self._held:
                if self._connection is not None and self._connection.is_open:
                    self._connection.close()
                return
            if channel is None or not channel.is_open:
                return
            layout = self._layout
            # Nothing goes out while returned messages wait for a newer layout, nor under a
            # newer epoch while messages of the older one may still be returned: a key's
            # later message must not be routed before its earlier one is republished.
            if self._held or (self._unconfirmed and self._wire_epoch != layout.epoch):
                return
            self._wire_epoch = layout.epoch
            framer = self._framer
            batch = list(self._outbox)
            self._outbox.clear()
            self._m_in_flight.set(self._outstanding)
            # Tagged before publishing: one lock for the batch, and a publish cut short
            # by a lost channel is already in _unconfirmed, so it is republished.
            tag = self._tag
            unconfirmed = self._unconfirmed
            for pending in batch:
                tag += 1
                unconfirmed[tag] = pending
            self._tag = tag
        if not batch or framer is None:
            return
        now = time.monotonic()
        for pending in batch:
            if pending.epoch != layout.epoch:  # prepared under an older layout
                self._reroute(pending, layout)
            pending.published_at = now
            framer.add(pending.routing_key, pending.properties, pending.body)
        framer.send()  # the batch in one write (the channel is open: checked above)
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
                if not pending.returned and pending.message_id == properties.message_id:
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
        held = self._held
        confirmed, failed, returned = self._outcomes(tags, done, nacked)
        self._resolve(confirmed, failed)  # all at once: one lock and one window release
        if nacked and not self._closing:
            self._recycle_after_nack()
        if returned and not held:
            log.warning(
                "stream %s: the broker returned a message of layout epoch %d (its bindings "
                "are cut: a resize): holding publishes until etcd has a newer layout",
                self.spec.name,
                returned[0].epoch,
            )
        if self._held and not self._unconfirmed:
            self._after_returns()
        elif self._closing or (
            self._outbox and not self._unconfirmed and self._wire_epoch != self._layout.epoch
        ):
            self._drain()  # closing, or messages of a newer epoch waited for these

    def _outcomes(
        self, tags: list[int], done: list[_Pending], nacked: bool
    ) -> tuple[
        list[_Pending], list[tuple[_Pending, PublishFailed | ProducerClosed]], list[_Pending]
    ]:
        """Confirmed, failed, and returned (kept for a newer layout) of a confirm frame."""
        confirmed: list[_Pending] = []
        failed: list[tuple[_Pending, PublishFailed | ProducerClosed]] = []
        returned: list[_Pending] = []
        for tag, pending in zip(tags, done, strict=True):
            if nacked:
                failed.append((pending, MessageNacked("the broker refused the message (nack)")))
            elif pending.returned and self._follower is not None:
                pending.returned = False
                returned.append(pending)
                with self._lock:  # republished once a newer layout is known
                    self._returned[tag] = pending
                    self._held = True
            elif pending.returned:
                failed.append((pending, self._unroutable(pending)))
            else:
                confirmed.append(pending)
        return confirmed, failed, returned

    def _unroutable(self, pending: _Pending, resizing: int | None = None) -> MessageUnroutable:
        """Why ``pending`` fails: its layout (epoch ``resizing``) was cut by a resize and no
        newer one came in time, or (None) its queue is simply not bound."""
        if resizing is not None:
            return MessageUnroutable(
                f"the broker returned a message of {self.spec.name!r} (partition "
                f"{pending.partition}, layout epoch {resizing}) and etcd had no newer layout "
                f"within {self._layout_timeout:g}s: finish the stream's resize, then publish "
                f"it again"
            )
        return MessageUnroutable(
            f"no queue is bound for partition {pending.partition} of "
            f"{self.spec.name!r}: run `partq stream create {self.spec.name} "
            f"--partitions {self.spec.partitions}` to declare its queues"
        )

    # -- returned messages: wait for a newer layout, then republish (I/O thread) ------------

    def _after_returns(self) -> None:
        """Every message sent is settled or returned: republish the returned ones under a
        newer layout if one is known, else wait for one on another thread."""
        epoch = max(pending.epoch for pending in self._returned.values())
        if self._layout.epoch > epoch:
            self._republish()
            return
        with self._lock:
            if self._awaiting_layout:
                return
            self._awaiting_layout = True
        threading.Thread(
            target=self._await_layout, args=(epoch,), name="partq-producer-layout", daemon=True
        ).start()

    def _await_layout(self, epoch: int) -> None:
        """Waiter thread: a layout newer than ``epoch`` (at most ``layout_timeout``; at once
        none when no resize runs: the queue is just not bound), then back to the I/O thread."""
        follower = self._follower
        found = None
        resizing = False
        try:
            if follower is not None:
                resizing = follower.resizing()
                wait = self._layout_timeout if resizing else 0.0
                found = follower.wait_newer(epoch, wait)
        finally:
            with self._lock:
                self._awaiting_layout = False
                connection = self._connection
        if found is not None and found.epoch > self._layout.epoch:
            self._on_spec(found)
        if connection is None:
            return  # reconnecting: the returned messages are sent again, in order
        with contextlib.suppress(Exception):  # the loop is closing: the requeue sends them
            connection.ioloop.add_callback_threadsafe(
                functools.partial(self._layout_waited, epoch, resizing)
            )

    def _layout_waited(self, epoch: int, resizing: bool) -> None:
        if not self._returned:
            return  # a reconnect requeued them meanwhile
        if self._layout.epoch > epoch:
            self._republish()
            return
        with self._lock:
            doomed = [self._returned[tag] for tag in sorted(self._returned)]
            self._returned.clear()
            self._held = False
        self._resolve([], [(p, self._unroutable(p, epoch if resizing else None)) for p in doomed])
        self._drain()

    def _republish(self) -> None:
        """The returned messages ahead of everything not yet sent, in their first order;
        ``_drain`` routes them (and every older message) under the current layout."""
        with self._lock:
            again = [self._returned[tag] for tag in sorted(self._returned)]
            self._returned.clear()
            self._held = False
            self._outbox.extendleft(reversed(again))
            self.rerouted += len(again)
        log.info(
            "stream %s: republishing %d returned messages under layout epoch %d",
            self.spec.name,
            len(again),
            self._layout.epoch,
        )
        self._drain()

    def _recycle_after_nack(self) -> None:
        """A nack: start over on a new connection (the next node of a list), at most once
        per ``_NACK_RECYCLE`` seconds. RabbitMQ 3.10 keeps nacking every publish on a channel
        whose quorum-queue leader died, though the queue has a new leader, while a new
        channel confirms at once (docs/history.md)."""
        now = time.monotonic()
        if now - self._recycled_at < _NACK_RECYCLE:
            return
        self._recycled_at = now
        log.warning("the broker nacked a publish: reconnecting (to %s)", self._nodes.where)
        channel = self._channel
        if channel is not None and channel.is_open:
            channel.close()  # -> _on_channel_closed -> the connection closes, then reconnects
