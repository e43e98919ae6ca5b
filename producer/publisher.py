"""The producer SDK's caller API: keyed, persistent, confirmed publishes with a bounded window.

:class:`Producer` is what users call: ``publish`` one message, ``publish_many`` a batch
(one lock and one wake-up of the I/O thread for the batch), ``flush``, ``close``, a context
manager. Each call returns a ``Future`` that resolves to a :class:`Receipt` when the broker
confirms the message. Confirms are pipelined: up to ``window`` messages are unconfirmed at
once, and ``publish`` blocks when the window is full (backpressure), so memory stays
bounded. A future never succeeds without the broker's confirm; after a reconnect every
unconfirmed message is republished in order (at-least-once: deduplicate by
``message_id``).

No message can poison the producer. ``publish`` encodes the message's properties in the
caller's thread, once (:func:`partq.producer.properties.properties_for`), so what AMQP
cannot carry (an int beyond 64 bits, a set, a ``message_id`` over 255 bytes, a key too long
for one frame) raises :class:`UsageError` there. A message the broker refuses (a body above
its ``max_message_size``) fails its own future with :class:`PublishFailed`.

The parts, by role:

- this module: the caller's API, and making a producer (spec, broker, the queue check);
- :mod:`partq.producer.ledger`: the outstanding publishes, the window, settling futures;
- :mod:`partq.producer.connection_loop`: the I/O thread, reconnecting, republishing;
- :mod:`partq.producer.reroute`: following the stream's layout through a resize;
- :mod:`partq.producer.properties` and :mod:`partq.producer.wire`: the bytes sent.

Threads. Any thread may call the methods here. ``publish``/``publish_many`` hash and encode
in the caller's thread, queue through the ledger (one lock; they block there on a full
window) and wake the I/O thread (at most one ``add_callback_threadsafe`` per burst). The
caller reads the current layout (``Rerouter.layout``, replaced whole by the watch's
thread) and the broker's ``Limits`` (written by the I/O thread) without a lock. ``flush``
waits on the ledger; ``close`` marks it closing, wakes the I/O thread, joins it (at most
10 s) and fails what is left on the closing thread. The constructing thread waits for the
first connection (``ConnectionLoop.start``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Protocol

from partq.producer.connection_loop import ConnectionLoop
from partq.producer.contract import StreamSpec, validate_stream_name
from partq.producer.follow import resizing_to
from partq.producer.futures import PublishFuture
from partq.producer.ledger import Ledger, Pending, Receipt
from partq.producer.properties import properties_for
from partq.producer.queue_probes import check_partition_queues
from partq.producer.registry import Registry
from partq.producer.reroute import watcher_of
from partq.producer.wire import HEADER_FRAME_OVERHEAD, Limits

from partq.kernel.amqp import AmqpURL, Nodes
from partq.kernel.errors import ProducerClosed, UsageError
from partq.kernel.settings import Settings

__all__ = ["BatchItem", "Producer", "Receipt", "SpecSource"]

log = logging.getLogger("partq.producer")

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
    follows = watcher_of(source)
    check_partition_queues(  # no queues beyond P, but those of a resize that runs
        amqp_url,
        spec,
        name=f"{name}-check",
        resizing_to=None if follows is None else functools.partial(resizing_to, follows, spec.name),
    )


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
        self._url = amqp_url
        nodes = Nodes.of(amqp_url, name=name, socket_timeout=connect_timeout)
        self._limits = Limits(nodes.current.frame_max - HEADER_FRAME_OVERHEAD)
        self._ledger = Ledger(spec.name, window, spec.epoch, on_settled)
        self._loop = ConnectionLoop(
            self._ledger,
            spec,
            nodes,
            self._limits,
            reconnect_timeout=reconnect_timeout,
            layout_timeout=layout_timeout,
            name=name,
        )
        self._routes = self._loop.routes
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()
        watcher = watcher_of(source)
        if watcher is not None:
            self._routes.follow(watcher)
        try:
            self._loop.start(connect_timeout)
        except BaseException:
            self._close_registry()
            raise

    @property
    def spec(self) -> StreamSpec:
        """The stream's spec, of the newest layout this producer knows."""
        return self._routes.spec

    @property
    def rerouted(self) -> int:
        """Messages returned by a cut layout and republished under a newer one."""
        return self._routes.rerouted

    @property
    def _outstanding(self) -> int:  # white-box tests watch the window through it
        return self._ledger.outstanding

    @property
    def _max_properties(self) -> int:  # white-box tests switch the caller's check off
        return self._limits.properties

    @_max_properties.setter
    def _max_properties(self, limit: int) -> None:
        self._limits.properties = limit

    def _close_registry(self) -> None:
        routes = getattr(self, "_routes", None)  # None until the rerouting is made
        if routes is not None:
            routes.stop_following()
        if self._registry is not None:
            self._registry.close()
            self._registry = None

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
        limit = self._limits.body
        if len(pending.body) > limit:  # the broker refused one this large: unsent
            self._ledger.refuse_unsent([pending], limit)
            return pending.future
        if self._ledger.admit(pending):
            self._loop.wake()
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

    def _prepare_batch(self, messages: Iterable[BatchItem], now: float) -> list[Pending]:
        """publish_many's first half: every message checked and encoded, none queued."""
        return [self._prepare(*_unpack(item), now) for item in messages]

    def _hand_over(self, batch: list[Pending]) -> list[Future[Receipt]]:
        """publish_many's second half: queue prepared messages in order, a window at a time."""
        futures: list[Future[Receipt]] = [pending.future for pending in batch]
        ledger = self._ledger
        limit = self._limits.body
        if limit != sys.maxsize and any(len(pending.body) > limit for pending in batch):
            ledger.refuse_unsent([p for p in batch if len(p.body) > limit], limit)
            batch = [pending for pending in batch if len(pending.body) <= limit]
        queued, total = 0, len(batch)
        while queued < total:
            try:
                take, wake = ledger.admit_some(batch, queued)
            except ProducerClosed as closed:
                if queued == 0:
                    raise
                for pending in batch[queued:]:
                    pending.future.set_exception(closed)
                ledger.settled([pending.future for pending in batch[queued:]])
                break
            queued += take
            if wake:
                self._loop.wake()
        return futures

    def _prepare(
        self,
        key: str | bytes,
        body: bytes | str,
        headers: Mapping[str, Any] | None,
        message_id: str | None,
        now: float,
    ) -> Pending:
        """One message, hashed and encoded in the caller's thread (its checks raise here)."""
        layout = self._routes.layout
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
        encoded, message_id = properties_for(
            key, partition, message_id, now, headers, self._limits.properties
        )
        routing_key = layout.routing_key(partition)
        return Pending(
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

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message published so far is confirmed or failed."""
        self._ledger.wait_idle(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, then close the connection; what is still pending then fails."""
        ledger = self._ledger
        if ledger.closing and not self._loop.is_alive():
            return
        try:
            self.flush(timeout)
        except TimeoutError:
            log.warning("closing with %d messages unconfirmed", ledger.outstanding)
        ledger.close()
        self._loop.wake()
        self._loop.join(timeout=10)
        ledger.fail_all(ProducerClosed("the producer was closed before the broker confirmed"))
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
