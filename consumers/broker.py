"""The consumer's RabbitMQ edge: one connection, one channel per partition, one I/O thread.

Threads. The I/O thread (this ``Thread``, ``<name>-amqp``) runs the ``SelectConnection``
loop and alone touches pika objects and the per-partition state (``_subs``, ``_standbys``,
``_warming``, ``_opening``, ``_deferred``, ``_missing``, ``_probe``). The controller and
the workers call the public methods, which hop onto the loop with
``add_callback_threadsafe`` (``_call``); ``ack`` appends to ``_acks`` under ``_acks_lock``
and schedules at most one ``_send_acks`` at a time. ``connected`` is a
``threading.Event``; ``_connection``, ``_fenced`` and ``_stopping`` are single references
written by one side and read by the other (a stale one makes ``_call`` refuse, or queue a
callback that never runs: ``run`` then reports those partitions lost). Every callback
(``deliver``, ``on_*``, the ``ready`` reply) runs on the I/O thread, except
``on_channel_lost`` when a public method finds no connection (the caller's thread): the
daemon's only put an event in its queue, or a delivery in a worker's inbox.

A planned drain never gives a message back to the broker if it can help it,
and when it cannot, the queue's own settings keep the order
(docs/architecture.md, "Returns"): a delivery that is in flight while
``basic.cancel`` is applied is returned by the broker's channel. A classic
queue requeues it in place; a quorum queue *with a delivery limit* (partq
declares every quorum partition queue with one, ``QUORUM_DELIVERY_LIMIT``)
puts it on its returns list, served before anything else; only a quorum queue
without a limit (a stream created before partq declared one, see
``upgrade_policy_command``) puts it at the back, behind newer messages of its key.

So ``cancel(p)``: (1) holds the partition's acks, so the broker gets no new
credit; (2) sends ``basic.cancel`` as soon as the broker provably has no credit
left: our own count of unacked deliveries equals the prefetch (see
``_window_full``); nothing can then be in flight. A partition that is idle or
slower than the prefetch never fills its window: it is cancelled once no
delivery arrived for ``_QUIET`` seconds and no message is ready in its queue (a
passive ``queue.declare`` round trip), or after
``_MAX_HOLD`` seconds of a trickle (logged). (3) After CancelOk, a round trip
(``basic.qos``) lets any delivery the broker sent before it arrive; then the
END mark follows them to the worker. The worker handles and acks everything;
``finish(p)`` sends the held acks, makes a round trip so they reach the broker,
and reports the partition drained.

With ``on_emptied`` (the daemon's), a full window takes a shorter way: the cancel waits
until the worker has also handled (and acked, into the hold) every delivery, and the
partition is reported *emptied* instead: nothing can arrive and nothing is left to handle,
so the controller releases the claim first and then calls ``cut(p)``: ``basic.cancel``,
the held acks after CancelOk, a round trip, drained. The next owner claims and subscribes
while the old one cancels; should it subscribe first, it waits at the broker behind the
old consumer (single active consumer) until the cancel, and is then served only messages
newer than any the old one had. The channel is *parked*, not closed (a
close right after the last acks could return messages whose settles the
quorum queue has not applied yet), and reused if the partition comes back;
channels close with the connection.

Acks (the per-message path): workers queue them (``ack``) and one I/O-loop callback
sends all that queued meanwhile (one thread hop per burst, not per message). A run of
one channel's acks that is exactly the oldest of its unacked deliveries, in delivery
order, goes as one ``basic.ack`` with ``multiple``; anything else is acked tag by tag,
so a multiple ack never covers a delivery the worker did not ack.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from consumers.priority import consume_arguments
from kernel.amqp import AmqpURL, Nodes, access_refused, unavailable
from kernel.backoff import Backoff, Delays
from producer.contract import StreamSpec

__all__ = ["END", "Broker", "Delivery", "abort_connection"]

log = logging.getLogger("partq.consumer.broker")
_STOP_GRACE = 1.0  # seconds between the last drain's acks and closing the connection
_QUIET = 0.25  # no delivery for this long while acks are held: nothing is in flight
# ... and a partition whose window has not filled by then (a steady trickle) is cancelled
# anyway. A shorter hold let a return reach the queue after the next owner was served
# (docs/history.md, "A shorter `_MAX_HOLD`"), so a trickling partition's handoff waits
# up to 5 s.
_MAX_HOLD = 5.0
_STANDBY_RECHECK = 0.2  # seconds between looks for the owner's consumer before standing by
_BACKOFF = Backoff()  # reconnects, and subscribes to a missing queue: 0.2 s doubling to 5 s


@dataclass(frozen=True, slots=True)
class Delivery:
    partition: int
    channel: Channel
    delivery_tag: int
    redelivered: bool
    properties: pika.BasicProperties
    body: bytes

    @classmethod
    def of(
        cls, partition: int, channel: Channel, method: Any, header_frame: Any, body: bytes
    ) -> Delivery:
        """From pika's Basic.Deliver, content header and body."""
        return cls(
            partition,
            channel,
            method.delivery_tag,
            method.redelivered,
            header_frame.properties,
            body,
        )


END = object()  # follows the last delivery of a cancelled subscription


def abort_connection(connection: Any) -> None:
    """Drop ``connection``'s TCP stream (a pika connection, asynchronous or a blocking one's
    ``_impl``) without an AMQP close, as a kill -9 would: ``shutdown`` sends the broker a FIN
    at once, and pika, reading EOF, reports the connection lost and closes the socket."""
    sock = getattr(getattr(connection, "_transport", None), "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _Subscription:
    """One partition's channel and drain bookkeeping (I/O thread only)."""

    channel: Channel
    tag: str | None = None
    received: int = 0
    acks_sent: int = 0
    holding: bool = False
    held: list[int] = field(default_factory=list)
    held_since: float = 0.0
    cancel_sent: bool = False
    drains: int = 0  # drains begun: a called-off one's timers see a newer count and stop
    consuming: bool = False
    emptied: bool = False  # reported emptied: the controller cuts it
    # delivery tags handed to the worker and not acked yet, in delivery order
    unacked: deque[int] = field(default_factory=deque)


@dataclass
class _Warm:
    """A channel opening for :meth:`Broker.warm` (I/O thread only)."""

    subscribe: bool = False  # subscribe was asked meanwhile: consume once it is warm


@dataclass
class _Standby:
    """A hot standby subscription: the queue's waiting consumer until the owner's goes.

    Deliveries (the broker activated it) are kept unhandled until the controller decides:
    :meth:`Broker.promote` (the owner died: they go to the worker) or
    :meth:`Broker.give_back` (a planned move: each is returned, in order, then cancel).
    """

    channel: Channel
    tag: str | None = None
    buffer: list[Delivery] = field(default_factory=list)
    activated: bool = False
    returning: bool = False


class Broker(threading.Thread):
    def __init__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        *,
        prefetch: int,
        heartbeat: int,
        name: str,
        deliver: Callable[[int, Delivery | object], None],
        on_subscribed: Callable[[int], None],
        on_drained: Callable[[int], None],
        on_channel_lost: Callable[[int], None],
        on_connection: Callable[[bool], None],
        on_refused: Callable[[int, str], None] | None = None,
        on_activated: Callable[[int], None] | None = None,
        on_standby_lost: Callable[[int], None] | None = None,
        on_emptied: Callable[[int], None] | None = None,
        on_kept: Callable[[int], None] | None = None,
    ) -> None:
        """``on_kept(partition)``: :meth:`resume` called a drain off (its acks were sent).
        ``on_emptied(partition)``: a drain's window is full and every delivery handled;
        the caller then calls :meth:`cut` (the module docstring). Without it, a full window
        is cancelled at once and the worker gets END. ``on_refused(partition, reason)``:
        RabbitMQ refused this user the partition's queue (403 ACCESS_REFUSED); ``reason`` is
        one line naming the queue, the user and the permission to grant. The partition is
        not subscribed again: retrying cannot help until the permission is granted.
        Without it, the reason is logged."""
        super().__init__(name=f"{name}-amqp", daemon=True)
        self.url = url
        self.spec = spec
        self.nodes = Nodes.of(url, name=name, heartbeat=heartbeat)
        self.prefetch = prefetch
        self._deliver = deliver
        self._on_subscribed = on_subscribed
        self._on_drained = on_drained
        self._on_channel_lost = on_channel_lost
        self._on_connection = on_connection
        self._on_refused = on_refused
        self._on_activated = on_activated or (lambda _p: None)
        self._on_standby_lost = on_standby_lost or (lambda _p: None)
        self._on_emptied = on_emptied
        self._on_kept = on_kept or (lambda _p: None)
        self._standbys: dict[int, _Standby | None] = {}  # None: its channel is opening
        self._connection: SelectConnection | None = None
        self._subs: dict[int, _Subscription] = {}
        self._opening: set[int] = set()
        self._warming: dict[int, _Warm] = {}  # channels opening for ``warm``
        # partition -> (retry not before, its delays): its queue was NOT_FOUND
        self._missing: dict[int, tuple[float, Delays]] = {}
        self._deferred: dict[int, object] = {}  # partition -> its pending deferred subscribe
        self._arguments: dict[int, dict[str, int] | None] = {}  # basic.consume's, per partition
        self._last_drain = 0.0
        self._acks: list[tuple[int, Channel, int]] = []  # queued by workers, sent by _send_acks
        self._acks_lock = threading.Lock()
        self._acks_scheduled = False
        self._stopping = False
        self._fenced: SelectConnection | None = None  # being aborted: nothing more on it
        self._probe: Channel | None = None  # passive declares for ``ready``
        self.connected = threading.Event()

    # -- thread-safe API -----------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> bool:
        connection = self._connection
        if connection is None or not connection.is_open or connection is self._fenced:
            return False
        try:
            connection.ioloop.add_callback_threadsafe(fn)
        except Exception:
            return False
        return True

    def subscribe(self, partition: int, priority: int | None = None) -> bool:
        """Start consuming ``partition``; False while disconnected (call again on reconnect).
        ``priority``: the consumer's ``x-priority`` (``consumers.priority``: an heir above
        the owner takes over once the owner has settled everything, on RabbitMQ 4 quorum)."""
        arguments = consume_arguments(priority)  # a bad value fails here, in the caller

        def do() -> None:
            self._arguments[partition] = arguments
            self._subscribe(partition)

        return self._call(do)

    def warm(self, partition: int) -> None:
        """Open ``partition``'s channel and set its prefetch now, without consuming, so that
        :meth:`subscribe` costs one round trip (``basic.consume``) once the claim is ours.
        Nothing is delivered on it before then."""
        self._call(lambda: self._warm(partition))

    def cancel(self, partition: int) -> None:
        """Begin draining ``partition``: the worker gets END after its last delivery."""
        if not self._call(lambda: self._revoke(partition)):
            self._on_channel_lost(partition)

    def resume(self, partition: int) -> None:
        """Call off ``partition``'s drain if its cancel is not sent yet: send the held acks
        and consume on (``on_kept``). Otherwise nothing: the drain goes on."""
        self._call(lambda: self._resume(partition))

    def cut(self, partition: int) -> None:
        """After ``on_emptied``: cancel ``partition``, send its held acks, report it drained."""
        if not self._call(lambda: self._cut(partition)):
            self._on_channel_lost(partition)

    def ack(self, partition: int, channel: Channel, delivery_tag: int) -> None:
        """Queue an ack; the I/O loop sends every ack queued by then in one callback (in
        the order queued, so before anything a worker asks for after its acks)."""
        with self._acks_lock:
            self._acks.append((partition, channel, delivery_tag))
            if self._acks_scheduled:
                return
            self._acks_scheduled = True
        if not self._call(self._send_acks):  # disconnected: those channels are gone anyway
            with self._acks_lock:
                self._acks.clear()
                self._acks_scheduled = False

    def close_channel(self, partition: int, channel: Channel) -> None:
        """Close ``channel`` (the broker requeues what was not acked on it): a worker left
        a delivery unhandled. If it is the partition's subscription, the partition is
        reported lost as for any closed channel. Nothing once fenced (``_call`` refuses): a
        graceful close would let the next owner be served first (``fence``)."""

        self._call(lambda: channel.close() if channel.is_open else None)

    def finish(self, partition: int, channel: Channel) -> None:
        """The worker handled everything up to END: send the held acks, then report."""
        if not self._call(lambda: self._finish(partition, channel)):
            self._on_channel_lost(partition)

    def stand_by(self, partition: int) -> bool:
        """Subscribe to ``partition`` as its hot standby (the waiting consumer)."""
        return self._call(lambda: self._stand_by(partition))

    def stand_down(self, partition: int) -> None:
        """No longer the standby (not activated: cancelled; activated: the controller's
        promote or give_back decides)."""
        self._call(lambda: self._stand_down(partition))

    def promote(self, partition: int) -> None:
        """The activated standby becomes the subscription: its deliveries go to the worker."""
        if not self._call(lambda: self._promote(partition)):
            self._on_channel_lost(partition)

    def give_back(self, partition: int) -> None:
        """Return the activated standby's deliveries in order, then cancel it."""
        self._call(lambda: self._give_back(partition))

    def ready(self, partitions: list[int], reply: Callable[[dict[int, int]], None]) -> None:
        """Ask RabbitMQ how many messages are ready in ``partitions``' queues (passive
        declares on a channel of their own); ``reply(counts)`` on the I/O thread. No reply
        while disconnected, or if a queue is missing (its 404 closes that channel)."""
        self._call(lambda: self._count_ready(list(partitions), {}, reply))

    def fence(self) -> None:
        """Our lease is gone: drop the connection, and every partition on it, by aborting its
        socket (no AMQP close), then connect again.

        Not ``channel.close`` or ``connection.close``: when a single-active-consumer queue's
        active consumer closes gracefully, RabbitMQ (3.10 quorum, 4.0 quorum and classic)
        serves the waiting consumer (our partition's next owner) a window of *newer*
        messages before the ones we held unacked; when the socket just drops, as with a
        kill -9, it serves the held ones first, in order (docs/benchmarks.md, "Fencing").

        Silent: the caller starts its partitions over, so no ``on_channel_lost`` or
        ``on_standby_lost`` is reported for what was on this connection. Acks for its
        channels are dropped (their sub is gone), so a handler still running for a fenced
        partition never acks onto the next connection.
        """

        connection = self._connection
        if connection is None or not connection.is_open:
            return  # nothing is subscribed: run() has reported every partition lost

        def do() -> None:
            self._deferred.clear()
            self._warming.clear()
            self._opening.clear()
            self._subs.clear()
            self._standbys.clear()
            abort_connection(connection)

        # From here on _call refuses this connection: a subscribe waits for the next one,
        # and a worker's close_channel or ack never reaches the broker.
        self._fenced = connection
        with contextlib.suppress(Exception):  # its loop is closing: gone anyway
            connection.ioloop.add_callback_threadsafe(do)

    def stop(self) -> None:
        self._stopping = True

        def close() -> None:
            if self._connection is not None and self._connection.is_open:
                self._connection.close()

        def do() -> None:
            # Acks sent just before a close may not be applied by a quorum queue yet.
            wait = max(0.0, self._last_drain + _STOP_GRACE - time.monotonic())
            if self._connection is not None:
                self._connection.ioloop.call_later(wait, close)

        if not self._call(do) and self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.ioloop.add_callback_threadsafe(self._connection.ioloop.stop)

    # -- the I/O thread: connection ------------------------------------------------------

    def run(self) -> None:
        delays = _BACKOFF.delays()
        while not self._stopping:
            connection = SelectConnection(
                self.nodes.current,
                on_open_callback=self._opened,
                on_open_error_callback=self._open_failed,
                on_close_callback=self._closed,
            )
            self._connection = connection
            connection.ioloop.start()
            self._connection = None
            connection.ioloop.close()  # its wake-up socket pair (and callbacks never run)
            self._drop_acks()
            if self.connected.is_set():
                delays.reset()
            self.connected.clear()
            self._on_connection(False)
            lost = sorted(p for p, sub in self._subs.items() if sub.consuming or sub.holding)
            pending = {p for p, warm in self._warming.items() if warm.subscribe}
            lost = sorted({*lost, *self._opening, *self._deferred, *pending})
            self._subs.clear()
            self._opening.clear()
            self._deferred.clear()
            self._warming.clear()
            standbys, self._standbys = self._standbys, {}
            for partition in lost:
                self._on_channel_lost(partition)
            for partition in sorted(standbys):
                self._on_standby_lost(partition)
            if self._stopping:
                return
            self.nodes.advance()  # a list's next node (the same one for a single URL)
            time.sleep(delays.next())

    def _open_failed(self, connection: SelectConnection, error: BaseException) -> None:
        log.warning("cannot connect to RabbitMQ: %s", unavailable(self.nodes.where, error))
        connection.ioloop.stop()

    def _opened(self, connection: SelectConnection) -> None:
        """Connected only once a channel takes our prefetch: a member that cannot open one
        could not consume its partitions, so it must not be in the group (the daemon joins
        on ``on_connection(True)``)."""

        def usable(channel: Channel) -> None:
            channel.close()
            log.info("connected to RabbitMQ at %s", self.nodes.where)
            self.connected.set()
            self._on_connection(True)

        def refused(_channel: Channel, reason: BaseException) -> None:
            if not self.connected.is_set() and connection.is_open:
                log.warning(
                    "RabbitMQ refused a channel with prefetch %d: %r", self.prefetch, reason
                )
                connection.close()

        def opened(channel: Channel) -> None:
            channel.add_on_close_callback(refused)
            channel.basic_qos(prefetch_count=self.prefetch, callback=lambda _f: usable(channel))

        connection.channel(on_open_callback=opened)

    def _closed(self, connection: SelectConnection, reason: BaseException) -> None:
        if connection is self._fenced:
            log.info("fenced: RabbitMQ connection aborted; connecting again")
        elif not self._stopping:
            log.warning("lost the RabbitMQ connection: %r", reason)
        connection.ioloop.stop()

    # -- the I/O thread: one partition ---------------------------------------------------

    def _subscribe(self, partition: int) -> None:
        assert self._connection is not None
        retry_at = self._missing[partition][0] if partition in self._missing else 0.0
        wait = retry_at - time.monotonic()
        if wait > 0:  # its queue was missing a moment ago: do not spin on NOT_FOUND
            token = object()
            self._deferred[partition] = token

            def later() -> None:
                if self._deferred.get(partition) is token:  # not revoked meanwhile
                    del self._deferred[partition]
                    self._subscribe(partition)

            self._connection.ioloop.call_later(wait, later)
            return
        if partition in self._warming:  # its channel is opening: consume once it is warm
            self._warming[partition].subscribe = True
            return
        parked = self._subs.get(partition)
        if partition in self._opening or (parked is not None and parked.consuming):
            return  # already (being) subscribed on this connection
        if parked is not None and parked.channel.is_open and not parked.consuming:
            self._consume(partition, parked.channel, new=False)  # closing could return acks
            return
        self._opening.add(partition)
        self._connection.channel(on_open_callback=lambda ch: self._consume(partition, ch))

    def _consume(self, partition: int, channel: Channel, *, new: bool = True) -> None:
        """Consume on ``channel``; a parked or warm one (not ``new``) has its prefetch."""
        self._opening.discard(partition)
        sub = _Subscription(channel, consuming=True)
        self._subs[partition] = sub
        if new:
            self._watch(partition, channel)
        self._route(partition, channel, sub)

        def on_qos(_frame: Any) -> None:
            sub.tag = channel.basic_consume(
                self.spec.queue(partition),
                lambda *_: None,  # unused: on_delivery above receives every delivery
                arguments=self._arguments.get(partition),
                callback=lambda _f: self._subscribed(partition),
            )

        if new:
            channel.basic_qos(prefetch_count=self.prefetch, callback=on_qos)
        else:  # every channel is parked right after a basic.qos with our prefetch
            on_qos(None)

    def _warm(self, partition: int) -> None:
        assert self._connection is not None
        if partition in self._subs or partition in self._opening or partition in self._warming:
            return
        warm = self._warming[partition] = _Warm()

        def ready(channel: Channel) -> None:
            if self._warming.get(partition) is not warm:
                # reset (fence, reconnect, a standby promoted meanwhile): never consumed on
                if channel.is_open and self._connection is not self._fenced:
                    channel.close()
                return
            if not channel.is_open:
                return  # closed: see closed()
            del self._warming[partition]
            if warm.subscribe:
                self._consume(partition, channel, new=False)
            else:
                self._subs[partition] = _Subscription(channel)  # parked, warm

        def closed(_channel: Channel, _reason: BaseException) -> None:
            if self._warming.get(partition) is warm:  # closed before it was warm
                del self._warming[partition]
                if warm.subscribe:
                    self._on_channel_lost(partition)

        def opened(channel: Channel) -> None:
            if self._warming.get(partition) is not warm:
                channel.close()
                return
            channel.add_on_close_callback(closed)
            self._watch(partition, channel)
            channel.basic_qos(prefetch_count=self.prefetch, callback=lambda _f: ready(channel))

        self._connection.channel(on_open_callback=opened)

    def _watch(self, partition: int, channel: Channel) -> None:
        channel.add_on_close_callback(
            lambda ch, reason: self._channel_closed(partition, ch, reason)
        )
        # The broker cancels a consumer by itself when its queue is deleted: no END
        # would ever follow, so the partition is reported lost (its channel closed).
        channel.add_on_cancel_callback(lambda _frame: self._cancelled(partition, channel))

    def _route(self, partition: int, channel: Channel, sub: _Subscription) -> None:
        """Every delivery on ``channel`` goes to the partition's worker. pika itself rejects
        (requeues) deliveries that arrive between basic.cancel and CancelOk and drops those
        after it. pika looks ``_on_deliver`` up on the instance for each delivery (pika 1.3
        and 1.4); tests/integration/test_broker_drain.py pins the effect."""

        def on_delivery(method_frame: Any, header_frame: Any, body: bytes) -> None:
            method = method_frame.method
            sub.received += 1
            if sub.emptied:  # cannot happen (no credit was left): never handle it here
                log.error("partition %d: a delivery after the window was full", partition)
                channel.basic_reject(method.delivery_tag, requeue=True)
                return
            sub.unacked.append(method.delivery_tag)
            full = sub.holding and not sub.cancel_sent and self._window_full(sub)
            if full and self._on_emptied is None:
                self._cancel(partition, sub)  # before handing it on: nothing else can come
            self._deliver(partition, Delivery.of(partition, channel, method, header_frame, body))

        channel._on_deliver = on_delivery

    # -- the I/O thread: hot standby -----------------------------------------------------

    def _stand_by(self, partition: int) -> None:
        assert self._connection is not None
        if partition in self._standbys or partition in self._opening:
            return
        sub = self._subs.get(partition)
        if sub is not None and (sub.consuming or sub.holding):
            return
        self._standbys[partition] = None
        self._connection.channel(on_open_callback=lambda ch: self._standby_open(partition, ch))

    def _standby_open(self, partition: int, channel: Channel) -> None:
        if partition not in self._standbys:  # stood down while the channel opened
            channel.close()
            return
        standby = self._standbys[partition] = _Standby(channel)
        channel.add_on_close_callback(
            lambda ch, _reason: self._standby_closed(partition, ch, standby)
        )

        def on_delivery(method_frame: Any, header_frame: Any, body: bytes) -> None:
            method = method_frame.method
            if standby.returning:  # given back: this one too, in order
                channel.basic_nack(method.delivery_tag, requeue=True)
                return
            standby.buffer.append(Delivery.of(partition, channel, method, header_frame, body))
            if not standby.activated:
                standby.activated = True
                self._on_activated(partition)

        channel._on_deliver = on_delivery

        queue = self.spec.queue(partition)

        def consume_behind(frame: Any) -> None:
            """Subscribe only behind a consumer: first, we would be the active one."""
            if not channel.is_open or standby.returning:
                return
            if frame.method.consumer_count < 1:
                assert self._connection is not None
                self._connection.ioloop.call_later(_STANDBY_RECHECK, check)
                return
            standby.tag = channel.basic_consume(queue, lambda *_: None)

        def check() -> None:
            if channel.is_open and not standby.returning and standby.tag is None:
                channel.queue_declare(queue, passive=True, callback=consume_behind)

        channel.basic_qos(prefetch_count=self.prefetch, callback=lambda _f: check())

    def _standby_closed(self, partition: int, channel: Channel, standby: _Standby) -> None:
        if self._standbys.get(partition) is standby:
            del self._standbys[partition]
            self._on_standby_lost(partition)

    def _stand_down(self, partition: int) -> None:
        if partition not in self._standbys:
            return
        standby = self._standbys[partition]
        if standby is None:  # still opening: _standby_open closes it
            del self._standbys[partition]
            return
        if not standby.activated:
            self._give_back(partition)

    def _give_back(self, partition: int) -> None:
        standby = self._standbys.pop(partition, None)
        if standby is None:
            return
        channel = standby.channel
        standby.returning = True
        if not channel.is_open:
            return
        for delivery in standby.buffer:  # one return each, in delivery order
            channel.basic_nack(delivery.delivery_tag, requeue=True)
        standby.buffer.clear()
        if standby.tag is None:
            channel.close()
        else:
            channel.basic_cancel(standby.tag, callback=lambda _f: channel.close())

    def _promote(self, partition: int) -> None:
        standby = self._standbys.pop(partition, None)
        if standby is None or not standby.channel.is_open:
            self._on_channel_lost(partition)
            return
        # A channel warming for the claim we were waiting for (the leader gave us the
        # partition before RabbitMQ activated us) must not become the partition's
        # subscription once warm: the worker's acks for the promoted channel would be
        # dropped as an old channel's, and no delivery would come past the prefetch.
        self._warming.pop(partition, None)
        warm = self._subs.get(partition)
        if warm is not None and warm.tag is None and warm.channel.is_open:
            warm.channel.close()  # warm, never consumed on: nothing to return
        channel = standby.channel
        sub = _Subscription(channel, tag=standby.tag, received=len(standby.buffer))
        sub.consuming = True
        self._subs[partition] = sub
        self._watch(partition, channel)
        self._route(partition, channel, sub)
        for delivery in standby.buffer:
            sub.unacked.append(delivery.delivery_tag)
            self._deliver(partition, delivery)
        standby.buffer.clear()

    def _count_ready(
        self, todo: list[int], counts: dict[int, int], reply: Callable[[dict[int, int]], None]
    ) -> None:
        """One passive declare after the other, then ``reply`` (``ready``)."""
        channel = self._probe
        if channel is None or not channel.is_open:
            assert self._connection is not None

            def opened(channel: Channel) -> None:
                self._probe = channel
                self._count_ready(todo, counts, reply)

            self._connection.channel(on_open_callback=opened)
            return
        if not todo:
            reply(counts)
            return
        partition, rest = todo[0], todo[1:]

        def counted(frame: Any) -> None:
            counts[partition] = frame.method.message_count
            self._count_ready(rest, counts, reply)

        channel.queue_declare(self.spec.queue(partition), passive=True, callback=counted)

    def _drop_acks(self) -> None:
        """The connection is gone, and a ``_send_acks`` queued on its loop with it: forget
        the acks (their channels are closed: the broker requeues those deliveries) so that
        the next ack schedules a send on the next connection."""
        with self._acks_lock:
            self._acks.clear()
            self._acks_scheduled = False

    def _send_acks(self) -> None:
        with self._acks_lock:
            acks, self._acks = self._acks, []
            self._acks_scheduled = False
        # Each channel's acks in the order queued (channels are independent of each other)
        runs: dict[tuple[int, int], tuple[int, Channel, list[int]]] = {}
        for partition, channel, tag in acks:
            run = runs.get((partition, id(channel)))
            if run is None:
                runs[(partition, id(channel))] = (partition, channel, [tag])
            else:
                run[2].append(tag)
        for partition, channel, tags in runs.values():
            self._ack(partition, channel, tags)

    def _ack(self, partition: int, channel: Channel, tags: list[int]) -> None:
        """Ack ``tags`` (in the order the worker acked them) of one partition's channel."""
        sub = self._subs.get(partition)
        if sub is None or sub.channel is not channel or not channel.is_open:
            return  # an old channel: the broker has requeued those deliveries already
        if sub.holding:
            sub.held.extend(tags)
            self._check_emptied(partition, sub)
            return
        unacked = sub.unacked
        count = len(tags)
        if count > 1 and list(itertools.islice(unacked, count)) == tags:
            channel.basic_ack(tags[-1], multiple=True)  # exactly the oldest `count` unacked
            for _ in range(count):
                unacked.popleft()
        else:
            for tag in tags:
                channel.basic_ack(tag)
                if unacked and unacked[0] == tag:
                    unacked.popleft()
                else:
                    with contextlib.suppress(ValueError):
                        unacked.remove(tag)
        sub.acks_sent += count

    def _revoke(self, partition: int) -> None:  # noqa: C901 — its quiet check closes over the drain
        self._deferred.pop(partition, None)
        sub = self._subs.get(partition)
        if sub is None or not sub.channel.is_open or not sub.consuming:
            self._on_channel_lost(partition)
            return
        sub.holding = True
        sub.held_since = time.monotonic()
        sub.drains += 1
        drain = sub.drains
        if self._window_full(sub):
            if self._on_emptied is None:
                self._cancel(partition, sub)
            else:
                self._check_emptied(partition, sub)
            return
        assert self._connection is not None
        ioloop = self._connection.ioloop

        def check(seen: int) -> None:
            """``seen`` deliveries had arrived _QUIET seconds ago: has one arrived since?"""
            if sub.drains != drain or not sub.holding:
                return  # called off (``resume``)
            if sub.cancel_sent or not sub.channel.is_open or self._emptying(sub):
                return
            if sub.received != seen and time.monotonic() - sub.held_since < _MAX_HOLD:
                ioloop.call_later(_QUIET, lambda seen=sub.received: check(seen))
                return
            # Quiet (or held too long): a round trip makes sure whatever the broker sent
            # before it has been read, also by a process that was stalled, and tells how
            # many messages are ready. Quiet with messages ready means the broker has no
            # credit for us *yet*: acks sent before the hold are not applied (a loaded
            # broker lags), and once they are, it delivers again. Cancelling then returns
            # those deliveries, and the next owner may be served before the returns are
            # applied, and a key is reordered (docs/history.md). So only
            # an empty queue counts as quiet.
            sub.channel.queue_declare(
                self.spec.queue(partition),
                passive=True,
                callback=lambda frame: confirm(seen, frame.method.message_count),
            )

        def confirm(seen: int, ready: int) -> None:
            if sub.drains != drain or not sub.holding:
                return  # called off (``resume``)
            if sub.cancel_sent or not sub.channel.is_open or self._emptying(sub):
                return
            waited = time.monotonic() - sub.held_since
            if (sub.received != seen or ready > 0) and waited < _MAX_HOLD:
                ioloop.call_later(_QUIET, lambda seen=sub.received: check(seen))
                return
            if sub.received != seen or ready > 0:
                log.warning(
                    "partition %d: cancelling after %.1fs while deliveries still arrive; one "
                    "in flight is returned to the head of the queue",
                    partition,
                    waited,
                )
            self._cancel(partition, sub)

        ioloop.call_later(_QUIET, lambda seen=sub.received: check(seen))

    def _window_full(self, sub: _Subscription) -> bool:
        """True when the broker provably has no credit left for this consumer.

        ``received - acks_sent`` never exceeds what the broker counts as unacked (acks can
        lag, deliveries can be in flight), and the broker never lets that exceed the
        prefetch: when ours equals it, nothing is in flight and, with acks held, nothing
        more can be sent. A cancel then returns nothing to the queue.
        """
        return sub.received - sub.acks_sent >= self.prefetch

    def _emptying(self, sub: _Subscription) -> bool:
        """The window is full and ``on_emptied`` will report it once all is handled."""
        return self._on_emptied is not None and self._window_full(sub)

    def _check_emptied(self, partition: int, sub: _Subscription) -> None:
        """Report ``partition`` emptied once its window is full (nothing can be in flight)
        and every delivery has been handled: its ack is held, so none is left to handle."""
        if (
            self._on_emptied is None
            or sub.emptied
            or sub.cancel_sent
            or not self._window_full(sub)
            or len(sub.held) < sub.received - sub.acks_sent
        ):
            return
        sub.emptied = True
        self._on_emptied(partition)

    def _resume(self, partition: int) -> None:
        """``resume`` on the I/O thread: un-hold a drain that has not cancelled."""
        sub = self._subs.get(partition)
        if sub is None or not sub.channel.is_open or not sub.consuming:
            return  # gone: on_channel_lost was (or will be) reported
        if not sub.holding or sub.cancel_sent:
            return  # not draining, or too late: drained follows
        sub.holding = False
        sub.emptied = False
        held, sub.held = sub.held, []
        if held:
            self._ack(partition, sub.channel, held)
        self._on_kept(partition)

    def _cut(self, partition: int) -> None:
        """``basic.cancel`` of an emptied partition, then its held acks, then drained."""
        sub = self._subs.get(partition)
        if sub is None or not sub.channel.is_open or not sub.consuming:
            self._on_channel_lost(partition)
            return
        if sub.cancel_sent:
            return
        sub.cancel_sent = True
        sub.emptied = True
        channel = sub.channel

        def after_cancel(_frame: Any) -> None:
            sub.consuming = False
            self._finish(partition, channel)

        if sub.tag is None:
            after_cancel(None)
        else:
            channel.basic_cancel(sub.tag, callback=after_cancel)

    def _cancel(self, partition: int, sub: _Subscription) -> None:
        """``basic.cancel``, a round trip for deliveries sent before it, then END to the worker."""
        if sub.cancel_sent or not sub.channel.is_open:
            return
        sub.cancel_sent = True
        channel = sub.channel

        def after_barrier(_frame: Any) -> None:
            sub.consuming = False
            self._deliver(partition, (END, channel))

        def after_cancel(_frame: Any) -> None:
            # A 3.10 quorum queue sends CancelOk before it cancels; if the cancel then fails
            # (no leader reachable), the broker closes the channel: its close callback
            # reports the partition lost. Raising here would abort the whole connection.
            if channel.is_open:
                channel.basic_qos(prefetch_count=self.prefetch, callback=after_barrier)

        if sub.tag is None:
            after_cancel(None)
        else:
            channel.basic_cancel(sub.tag, callback=after_cancel)

    def _finish(self, partition: int, channel: Channel) -> None:
        sub = self._subs.get(partition)
        if sub is None or sub.channel is not channel or not channel.is_open:
            self._on_channel_lost(partition)
            return
        for tag in sub.held:
            channel.basic_ack(tag)
        sub.acks_sent += len(sub.held)
        sub.held.clear()
        sub.holding = False

        def acked(_frame: Any) -> None:
            self._last_drain = time.monotonic()
            self._on_drained(partition)

        channel.basic_qos(prefetch_count=self.prefetch, callback=acked)  # the acks went first

    def _subscribed(self, partition: int) -> None:
        self._missing.pop(partition, None)
        self._on_subscribed(partition)

    def _cancelled(self, partition: int, channel: Channel) -> None:
        log.warning("partition %d: RabbitMQ cancelled the consumer (queue deleted?)", partition)
        if channel.is_open:
            channel.close()  # -> _channel_closed -> on_channel_lost

    def _channel_closed(self, partition: int, channel: Channel, reason: BaseException) -> None:
        if getattr(reason, "reply_code", None) == 404:  # NOT_FOUND: the queue does not exist
            _, delays = self._missing.get(partition, (0.0, _BACKOFF.delays()))
            self._missing[partition] = (time.monotonic() + delays.next(), delays)
        sub = self._subs.get(partition)
        if sub is None or sub.channel is not channel:
            return
        if self._connection is None or not self._connection.is_open:
            return  # the connection is going down: run() reports every partition it had
        del self._subs[partition]
        if getattr(reason, "reply_code", None) == 403:  # ACCESS_REFUSED: not lost, refused
            text = str(getattr(reason, "reply_text", reason))
            why = access_refused(self.url, text, "read")  # basic.qos needs none: the consume
            if self._on_refused is None:
                log.error("partition %d: %s", partition, why)
            else:
                self._on_refused(partition, why)
            return
        if sub.consuming or sub.holding:
            log.warning("partition %d: channel closed: %r", partition, reason)
            self._on_channel_lost(partition)
