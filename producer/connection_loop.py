"""The producer's connection loop: its I/O thread, connecting, reconnecting, sending.

One I/O thread (``<name>-io``) owns a pika ``SelectConnection`` (a
:class:`partq.producer.wire.ConfirmingConnection`), its channel and :class:`Framer`. It
drains the ledger's outbox onto the wire, a batch per wake-up, hands confirm frames and
returns to the ledger, and fails what the broker refuses for good (a body above its
``max_message_size``: that message alone; a header frame above ``frame_max``; a missing
exchange: everything). On connection loss it reconnects with backoff (the next node of a
list) and **republishes every unconfirmed message, in the original order, before any newer
one**, with the same ``message_id`` (the ledger puts them back in front of the outbox); if
no connection can be made within ``reconnect_timeout`` every pending future fails with
:class:`ConnectionLost`. A nack makes it start over on a new connection (at most once per
``_NACK_RECYCLE`` seconds). Should the thread itself fail, every pending and later publish
fails with :class:`ProducerClosed` naming the cause.

Threads. Every method but :meth:`ConnectionLoop.start`, :meth:`~ConnectionLoop.wake`,
``is_alive`` and ``join`` runs on the I/O thread. ``connection``, ``_channel`` and
``_framer`` are written by it under the ledger's lock, and read under it by
:meth:`~ConnectionLoop.wake` (any thread: callers of ``publish``, ``close``, the etcd watch's
thread) and the rerouting's waiter thread, which hand work over with one
``add_callback_threadsafe`` per burst (the ledger's ``wake_scheduled``). ``start`` (the
constructing thread) waits on ``_ready`` for the first connection, or for
``_first_error``, written before ``_ready`` is set. ``Limits`` are written here and read
by callers without a lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pika
import pika.exceptions
import pika.frame
import pika.spec
from partq.producer import metrics
from partq.producer.contract import StreamSpec
from partq.producer.ledger import Ledger
from partq.producer.reroute import Rerouter
from partq.producer.wire import (
    HEADER_FRAME_OVERHEAD,
    ConfirmingConnection,
    Framer,
    Limits,
    body_limit,
    body_refused,
    frame_limit,
    frame_refused,
)
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import Nodes, unavailable
from partq.kernel.backoff import Backoff
from partq.kernel.errors import BrokerUnavailable, ConnectionLost

__all__ = ["ConnectionLoop"]

log = logging.getLogger("partq.producer")

_NACK_RECYCLE = 5.0  # seconds between reconnects caused by nacks
_RECONNECT = Backoff(initial=0.1, maximum=2.0)  # between connection attempts


class ConnectionLoop:
    """The I/O thread of one producer (see the module); ``routes`` is its rerouting."""

    def __init__(
        self,
        ledger: Ledger,
        spec: StreamSpec,
        nodes: Nodes,
        limits: Limits,
        *,
        reconnect_timeout: float,
        layout_timeout: float,
        name: str,
    ) -> None:
        self._ledger = ledger
        self._nodes = nodes
        self._limits = limits
        self._reconnect_timeout = reconnect_timeout
        self._open_errors: list[str] = []  # the first connection's, one per node tried
        self._recycled_at = 0.0  # when a nack last made us reconnect
        self.connection: SelectConnection | None = None
        self._channel: Channel | None = None
        self._framer: Framer | None = None  # the channel's
        self._ready = threading.Event()
        self._first_error: BaseException | None = None
        self._connected_once = False
        self._m_published = metrics.PUBLISHED.labels(spec.name)
        self.routes = Rerouter(spec, layout_timeout, ledger, limits, self)
        self._io = threading.Thread(target=self._run, name=f"{name}-io", daemon=True)

    # -- any thread --------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Start the I/O thread; wait for its first connection, or raise why there is none."""
        self._io.start()
        if not self._ready.wait(timeout + 1) or self._first_error is not None:
            self._ledger.closing = True
            self.wake()
            raise self._first_error or BrokerUnavailable(
                f"no connection to RabbitMQ within {timeout:.0f}s"
            )

    def wake(self) -> None:
        ledger = self._ledger
        with ledger.lock:
            connection = self.connection
            if connection is None or ledger.wake_scheduled:
                return
            ledger.wake_scheduled = True
        try:
            connection.ioloop.add_callback_threadsafe(self.drain)
        except Exception:  # the loop is closing; the reconnect path drains the outbox
            with ledger.lock:
                ledger.wake_scheduled = False

    def is_alive(self) -> bool:
        return self._io.is_alive()

    def join(self, timeout: float) -> None:
        self._io.join(timeout=timeout)

    # -- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here or in pika: nobody may wait on a dead thread
            self._crash(e)

    def _crash(self, error: BaseException) -> None:
        """The I/O thread failed: fail every pending publish and refuse later ones, now."""
        ledger = self._ledger
        with ledger.lock:
            if ledger.crashed is not None:
                return
            ledger.crashed = error
            ledger.closing = True
            self.connection = None
            self._channel = None
            self._framer = None
            ledger.space.notify_all()  # publishers blocked on a full window: ProducerClosed
        log.error("the producer's I/O thread failed: %r", error, exc_info=error)
        closed = ledger.closed_error()
        if not self._ready.is_set():  # __init__ is still waiting for the first connection
            self._first_error = closed
            self._ready.set()
        ledger.fail_all(closed)

    def _loop(self) -> None:
        ledger = self._ledger
        lost_since: float | None = None
        delays = _RECONNECT.delays()
        while True:
            self._connect_once()
            with ledger.lock:
                self.connection = None
                self._channel = None
                self._framer = None
                ledger.wake_scheduled = False
                ledger.requeue_sent()
                closing = ledger.closing
            if closing:
                return
            if self._first_error is not None:
                return  # the first connection failed: __init__ reports it
            now = time.monotonic()
            lost_since = lost_since or now
            if now - lost_since > self._reconnect_timeout:
                ledger.fail_all(
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
            limit = frame_limit(str(reason.reply_text))
            if limit is not None:  # a header frame above frame_max: reconnecting cannot help
                self._ledger.refuse(
                    lambda pending: len(pending.properties) > limit,
                    lambda pending: frame_refused(len(pending.properties), limit),
                )
        if not self._ledger.closing:
            self._nodes.advance()
            log.warning(
                "lost the RabbitMQ connection: %s; reconnecting to %s", reason, self._nodes.where
            )
        connection.ioloop.stop()

    def _on_channel_open(self, channel: Channel) -> None:
        ledger = self._ledger
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm)
        channel.connection.route_confirms(channel.channel_number, self._on_confirm)
        self._limits.properties = channel.connection.params.frame_max - HEADER_FRAME_OVERHEAD
        with ledger.lock:
            self.connection = channel.connection
            self._channel = channel
            self._framer = Framer(
                channel.connection, channel.channel_number, self.routes.spec.exchange
            )
            ledger.tag = 0
            ledger.wake_scheduled = False
        self._connected_once = True
        self._ready.set()
        self.drain()

    def _on_channel_closed(self, channel: Channel, reason: BaseException) -> None:
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            self._on_refusal(reason.reply_code, str(reason.reply_text))
        connection = channel.connection
        if connection.is_open:
            connection.close()

    def _on_refusal(self, code: int, text: str) -> None:
        """The broker closed the channel: fail what republishing cannot help."""
        too_large = body_limit(text)
        if code == 404:  # the exchange is gone
            spec = self.routes.spec
            self._ledger.fail_all(
                ConnectionLost(
                    f"exchange {spec.exchange} does not exist ({text}): "
                    f"create the stream with `partq stream create {spec.name}`"
                )
            )
        elif too_large is not None:
            # A body above the broker's max_message_size: that message alone fails (the
            # others are republished), and later ones as large fail in publish(), unsent.
            limit = self._limits.body = too_large
            self._ledger.refuse(
                lambda pending: len(pending.body) > limit,
                lambda pending: body_refused(len(pending.body), limit),
            )

    def drain(self) -> None:
        """Send what the outbox holds, a batch in one write (the I/O thread)."""
        ledger = self._ledger
        with ledger.lock:
            ledger.wake_scheduled = False
            channel = self._channel
            if ledger.closing and not ledger.outbox and not ledger.unconfirmed and not ledger.held:
                if self.connection is not None and self.connection.is_open:
                    self.connection.close()
                return
            if channel is None or not channel.is_open:
                return
            layout = self.routes.layout
            batch = ledger.take_outbox(layout.epoch)
            framer = self._framer
        if not batch or framer is None:
            return
        now = time.monotonic()
        for pending in batch:
            if pending.epoch != layout.epoch:  # prepared under an older layout
                self.routes.reroute(pending, layout)
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
        self._ledger.mark_returned(properties.message_id)

    def _on_confirm(self, frame: pika.frame.Method) -> None:
        ledger, routes = self._ledger, self.routes
        method = frame.method
        held, returned = ledger.settle_frame(method, routes.follower is not None, routes.unroutable)
        if isinstance(method, pika.spec.Basic.Nack) and not ledger.closing:
            self._recycle_after_nack()
        if returned and not held:
            routes.holding(returned[0].epoch)
        if ledger.held and not ledger.unconfirmed:
            routes.after_returns()
        elif ledger.closing or (
            ledger.outbox and not ledger.unconfirmed and ledger.wire_epoch != routes.layout.epoch
        ):
            self.drain()  # closing, or messages of a newer epoch waited for these

    def _recycle_after_nack(self) -> None:
        """A nack: start over on a new connection (the next node of a list), at most once
        per ``_NACK_RECYCLE`` seconds. RabbitMQ 3.10 keeps nacking every publish on a channel
        whose quorum-queue leader died, though the queue has a new leader, while a new
        channel confirms at once."""
        now = time.monotonic()
        if now - self._recycled_at < _NACK_RECYCLE:
            return
        self._recycled_at = now
        log.warning("the broker nacked a publish: reconnecting (to %s)", self._nodes.where)
        channel = self._channel
        if channel is not None and channel.is_open:
            channel.close()  # -> _on_channel_closed -> the connection closes, then reconnects
