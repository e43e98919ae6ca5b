"""The consumer's RabbitMQ edge: one connection, one channel per partition, one I/O thread.

:class:`Broker` implements :class:`partq.consumers.broker.port.BrokerPort`. It keeps the connection
(reconnecting with a backoff, over a node list) and hops every request onto the I/O loop;
the partitions' channels are :class:`partq.consumers.broker.channels.Channels`' slots, and each
subscription's drain is the pure window of :mod:`partq.consumers.state.window` (its docstring gives
the drain's steps and why each is safe). Everything it learns goes to the one ``sink``.

A planned drain never gives a message back to the broker if it can help it, and when it
cannot, the queue's own settings keep the order (docs/architecture.md, "Returns"): a
delivery that is in flight while ``basic.cancel`` is applied is returned by the broker's
channel. A classic queue requeues it in place; a quorum queue *with a delivery limit*
(partq declares every quorum partition queue with one, ``QUORUM_DELIVERY_LIMIT``) puts it
on its returns list, served before anything else; only a quorum queue without a limit (a
stream created before partq declared one, see ``upgrade_policy_command``) puts it at the
back, behind newer messages of its key.

With ``early_release`` (quorum queues), the next owner claims and subscribes while the old
one cancels; should it subscribe first, it waits at the broker behind the old consumer
(single active consumer) until the cancel, and is then served only messages newer than any
the old one had.

Threads. The I/O thread (this ``Thread``, ``<name>-amqp``) runs the ``SelectConnection``
loop and alone touches pika objects, ``_channels`` (the per-partition slots) and ``_probe``. The
controller and the workers call the public methods, which hop onto the loop with
``add_callback_threadsafe`` (``_call``); ``ack`` puts into ``_acks`` (an
:class:`AckQueue`, locked) and schedules at most one ``_send_acks`` at a time (one thread
hop per burst, not per message). ``connected`` is a ``threading.Event``; ``_connection``,
``_fenced`` and ``_stopping`` are single references written by one side and read by the
other (a stale one makes ``_call`` refuse, or queue a callback that never runs: ``run``
then reports those partitions lost). The sink is called on the I/O thread, except for a
``ChannelLost`` when a public method finds no connection (the caller's thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from partq.consumers.broker.acks import AckQueue
from partq.consumers.broker.channels import Channels
from partq.consumers.broker.port import ChannelLost, Connection, ReadyCounts, Sink
from partq.consumers.state.priority import consume_arguments
from partq.producer.contract import StreamSpec
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL, Nodes, abort_connection, unavailable
from partq.kernel.backoff import Backoff

__all__ = ["Broker"]

log = logging.getLogger("partq.consumer.broker")
_STOP_GRACE = 1.0  # seconds between the last drain's acks and closing the connection
_BACKOFF = Backoff()  # reconnects: 0.2 s doubling to 5 s


class Broker(threading.Thread):
    def __init__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        *,
        prefetch: int,
        heartbeat: int,
        name: str,
        sink: Sink,
        early_release: bool = False,
    ) -> None:
        """``sink``: every event (``partq.consumers.broker.port``). ``early_release``: a full window
        waits for its worker and is reported ``Emptied`` (the controller then calls
        :meth:`cut`); without it, it is cancelled at once and the worker gets END."""
        super().__init__(name=f"{name}-amqp", daemon=True)
        self.url = url
        self.spec = spec
        self.nodes = Nodes.of(url, name=name, heartbeat=heartbeat)
        self.prefetch = prefetch
        self._sink = sink
        self._channels = Channels(url, spec, prefetch=prefetch, early=early_release, sink=sink)
        self._connection: SelectConnection | None = None
        self._acks = AckQueue()  # queued by workers, sent by _send_acks
        self._stopping = False
        self._fenced: SelectConnection | None = None  # being aborted: nothing more on it
        self._probe: Channel | None = None  # passive declares for ``ready`` (I/O thread)
        self.connected = threading.Event()
        self.server_version = ""  # the RabbitMQ version the last connection reported

    # -- thread-safe API -----------------------------------------------------------------

    @property
    def fills(self) -> tuple[int, int]:
        """(drains that filled their window, fillers published) so far:
        ``partq.consumers.broker.fillers``."""
        fillers = self._channels.fillers
        return fillers.filled, fillers.sent

    def _call(self, fn: Callable[[], None]) -> bool:
        connection = self._connection
        if connection is None or not connection.is_open or connection is self._fenced:
            return False
        try:
            connection.ioloop.add_callback_threadsafe(fn)
        except Exception:
            return False
        return True

    def _call_or_lost(self, partition: int, fn: Callable[[], None]) -> None:
        if not self._call(fn):
            self._sink(ChannelLost(partition))

    def subscribe(
        self, partition: int, generation: int, priority: int | None = None, *, adopt: bool = False
    ) -> bool:
        """Start consuming ``partition``; False while disconnected (call again on reconnect).
        ``priority``: the consumer's ``x-priority`` (``partq.consumers.state.priority``: an heir
        above
        the owner takes over once the owner has settled everything, on RabbitMQ 4 quorum).
        ``adopt``: by making our standby subscription of it the partition's (``Channels``)."""
        arguments = consume_arguments(priority)  # a bad value fails here, in the caller
        return self._call(
            lambda: self._channels.subscribe(partition, generation, arguments, adopt=adopt)
        )

    def warm(self, partition: int) -> None:
        """Open ``partition``'s channel and set its prefetch now, without consuming, so that
        :meth:`subscribe` costs one round trip (``basic.consume``) once the claim is ours.
        Nothing is delivered on it before then."""
        self._call(lambda: self._channels.warm(partition))

    def cancel(self, partition: int, *, waiting: bool = False) -> None:
        """Begin draining ``partition``: the worker gets END after its last delivery.
        ``waiting``: another member holds the claim, so RabbitMQ serves its consumer, not
        ours: cancelled at once if nothing it was sent is unsettled
        (``partq.consumers.state.window.Revoke``)."""
        self._call_or_lost(partition, lambda: self._channels.revoke(partition, waiting=waiting))

    def resume(self, partition: int) -> None:
        """Call off ``partition``'s drain if its cancel is not sent yet: send the held acks
        and consume on (``Kept``). Otherwise nothing: the drain goes on."""
        self._call(lambda: self._channels.resume(partition))

    def cut(self, partition: int) -> None:
        """After ``Emptied``: cancel ``partition``, send its held acks, report it drained."""
        self._call_or_lost(partition, lambda: self._channels.cut(partition))

    def ack(self, partition: int, channel: Channel, delivery_tag: int) -> None:
        """Queue an ack; the I/O loop sends every ack queued by then in one callback (in
        the order queued, so before anything a worker asks for after its acks)."""
        if self._acks.put(partition, channel, delivery_tag) and not self._call(self._send_acks):
            self._acks.drop()  # disconnected: those channels are gone anyway

    def close_channel(self, partition: int, channel: Channel) -> None:
        """Close ``channel`` (the broker requeues what was not acked on it): a worker left
        a delivery unhandled. If it is the partition's subscription, the partition is
        reported lost as for any closed channel. Nothing once fenced (``_call`` refuses): a
        graceful close would let the next owner be served first (``fence``)."""

        self._call(lambda: channel.close() if channel.is_open else None)

    def finish(self, partition: int, channel: Channel) -> None:
        """The worker handled everything up to END: send the held acks, then report."""
        self._call_or_lost(partition, lambda: self._channels.finish(partition, channel))

    def stand_by(self, partition: int, priority: int | None = None) -> bool:
        """Subscribe to ``partition`` as its hot standby (the waiting consumer), or, with a
        ``priority`` above its owner's, as its heir (``partq.consumers.state.priority``)."""
        arguments = consume_arguments(priority)
        return self._call(lambda: self._channels.stand_by(partition, arguments))

    def stand_down(self, partition: int) -> None:
        """No longer the standby (not activated: its connection aborted; activated: the
        controller's promote or give_back decides)."""
        self._call(lambda: self._channels.stand_down(partition))

    def promote(self, partition: int, generation: int) -> None:
        """The activated standby becomes the subscription: its deliveries go to the worker."""
        self._call_or_lost(partition, lambda: self._channels.promote(partition, generation))

    def give_back(self, partition: int) -> None:
        """End the standby by aborting its own connection: the queue returns what it was
        sent, in order, ahead of anything newer (``Channels.give_back``)."""
        self._call(lambda: self._channels.give_back(partition))

    def widen(self, spec: StreamSpec) -> None:
        """A resize added partitions (``spec``'s): their queues are known from now on (the
        spec is replaced whole; the I/O thread reads it per subscribe)."""
        self.spec = self._channels.spec = spec

    def ready(self, partitions: list[int]) -> None:
        """Ask RabbitMQ how many messages are ready in ``partitions``' queues (passive
        declares on a channel of their own): ``ReadyCounts``. None while disconnected, or if
        a queue is missing (its 404 closes that channel)."""
        self._call(lambda: self._count_ready(list(partitions), {}))

    def fence(self) -> None:
        """Our lease is gone: drop the connection, and every partition on it, by aborting its
        socket (no AMQP close), then connect again.

        Not ``channel.close`` or ``connection.close``: when a single-active-consumer queue's
        active consumer closes gracefully, RabbitMQ (3.10 quorum, 4.0 quorum and classic)
        serves the waiting consumer (our partition's next owner) a window of *newer*
        messages before the ones we held unacked; when the socket just drops, as with a
        kill -9, it serves the held ones first, in order (docs/benchmarks.md, "Fencing").

        Silent: the caller starts its partitions over, so no ``ChannelLost`` or
        ``StandbyLost`` is reported for what was on this connection. Acks for its
        channels are dropped (their sub is gone), so a handler still running for a fenced
        partition never acks onto the next connection.
        """

        connection = self._connection
        if connection is None or not connection.is_open:
            return  # nothing is subscribed: run() has reported every partition lost

        def do() -> None:
            self._channels.fence()
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
            wait = max(0.0, self._channels.last_drain + _STOP_GRACE - time.monotonic())
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
            self._channels.attach(connection, self.nodes.where)
            connection.ioloop.start()
            self._connection = None
            connection.ioloop.close()  # its wake-up socket pair (and callbacks never run)
            # a _send_acks queued on its loop went with it: the next ack schedules one anew
            self._acks.drop()  # (their channels are closed: the broker requeues those)
            if self.connected.is_set():
                delays.reset()
            self.connected.clear()
            self._sink(Connection(False))
            self._channels.reset()  # ChannelLost and StandbyLost for what it had
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
        on ``Connection(True)``)."""

        def usable(channel: Channel) -> None:
            channel.close()
            version = (connection.server_properties or {}).get("version", "")
            self.server_version = version.decode() if isinstance(version, bytes) else str(version)
            log.info("connected to RabbitMQ at %s", self.nodes.where)
            self.connected.set()
            self._sink(Connection(True))

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

    def _send_acks(self) -> None:
        for partition, channel, tags in self._acks.take():
            self._channels.ack(partition, channel, tags)

    def _count_ready(self, todo: list[int], counts: dict[int, int]) -> None:
        """One passive declare after the other, then ``ReadyCounts``."""
        channel = self._probe
        if channel is None or not channel.is_open:
            assert self._connection is not None

            def opened(channel: Channel) -> None:
                self._probe = channel
                self._count_ready(todo, counts)

            self._connection.channel(on_open_callback=opened)
            return
        if not todo:
            self._sink(ReadyCounts(counts))
            return
        partition, rest = todo[0], todo[1:]

        def counted(frame: Any) -> None:
            counts[partition] = frame.method.message_count
            self._count_ready(rest, counts)

        channel.queue_declare(self.spec.queue(partition), passive=True, callback=counted)
