"""Hot standby subscriptions: each on a connection of its own, beside the owner's.

:class:`HotStandby` is a part of :class:`partq.consumers.broker.channels.Channels`: it
stands a partition's standby up (``stand_by``), stands it down or gives it back, promotes
it for the worker or adopts it as the partition's subscription, and keeps the standbys'
connections (and those taken over), to abort them.

A hot standby subscribes on a connection of its own, and ends by aborting that connection's
socket, never by ``basic.cancel``: RabbitMQ may have activated it (the owner's connection
died) and sent it deliveries, and one still on its way when a cancel is applied is returned
by the broker's channel at once, ahead of the older ones its client returns after
cancel-ok (seen on RabbitMQ 3.10: the newest delivery served first to the next consumer).
A dropped connection instead has the queue return everything its consumer held, in order,
before it serves any other consumer (docs/benchmarks.md, "Fencing"). A standby taken over
or adopted keeps its connection: it is the partition's subscription from then on.

Threads. Everything here runs on the broker's pika I/O thread, like the rest of
``Channels``: the standbys' connections share its I/O loop, so nothing is locked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from partq.consumers.broker.fillers import Fillers
from partq.consumers.broker.port import Activated, ChannelLost, Delivery, Sink, StandbyLost
from partq.consumers.broker.slots import _Opening, _Slot, _Standby, _Sub
from partq.consumers.state import window as w
from partq.consumers.state.priority import Arguments, rank
from partq.producer.contract import StreamSpec
from pika import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL, abort_connection, unavailable

__all__ = ["Connect", "HotStandby", "select_connection"]

log = logging.getLogger("partq.consumer.broker")
_STANDBY_RECHECK = 0.2  # seconds between looks for the owner's consumer before standing by
_STANDBY_RETRY = 1.0  # seconds before a standby whose connection failed is reported lost

# Opens a connection of a standby's own beside ``main``, on its I/O loop: (main, on_open,
# on_open_error, on_close) -> the connection, opening.
Connect = Callable[
    [
        Any,
        Callable[[Any], None],
        Callable[[Any, BaseException], None],
        Callable[[Any, BaseException], None],
    ],
    Any,
]


def select_connection(
    main: Any,
    on_open: Callable[[Any], None],
    on_failed: Callable[[Any, BaseException], None],
    on_closed: Callable[[Any, BaseException], None],
) -> Any:
    """A pika ``SelectConnection`` to ``main``'s node, with its parameters, on its loop."""
    return SelectConnection(
        main.params,
        on_open_callback=on_open,
        on_open_error_callback=on_failed,
        on_close_callback=on_closed,
        custom_ioloop=main.ioloop,
    )


class HotStandby:
    """The standbys' half of :class:`partq.consumers.broker.channels.Channels` (its state
    is set there)."""

    spec: StreamSpec
    prefetch: int
    sink: Sink
    connection: Any
    where: AmqpURL
    connect: Connect
    fillers: Fillers
    _own: set[Any]

    if TYPE_CHECKING:

        def _slot(self, partition: int) -> _Slot: ...

        def _window(
            self, partition: int, phase: w.Phase = w.Phase.CONSUMING, received: int = 0
        ) -> w.Window: ...

        def _watch(self, partition: int, channel: Channel) -> None: ...

        def _route(self, partition: int, sub: _Sub) -> None: ...

        def _subscribed(self, partition: int) -> None: ...

        def _feed(self, partition: int, sub: _Sub, event: w.WindowEvent) -> None: ...

    def _abort_own(self, *, loop_closed: bool = False) -> None:
        """Abort every standby's connection (and every one taken over): what they held goes
        back in order. ``loop_closed``: their I/O loop is gone, so their sockets are closed
        here too."""
        own, self._own = self._own, set()
        for connection in own:
            abort_connection(connection, close=loop_closed)

    def _end_own(self, connection: Any) -> None:
        """Abort one connection of ours, if it is one (the subscription on it ended)."""
        if connection in self._own:
            self._own.discard(connection)
            abort_connection(connection)

    def stand_by(self, partition: int, arguments: Arguments = None) -> None:
        slot = self._slot(partition)
        if slot.standby is not None:  # standing already
            return
        if not self.connection.is_open:  # closed since it was asked: no standby on it
            self.sink(StandbyLost(partition))
            return
        if isinstance(slot.line, _Opening) or (slot.sub is not None and slot.sub.window.live):
            self._not_beside_own(partition)
            return
        standby = slot.standby = _Standby(arguments=arguments)
        main = self.connection

        def opened(connection: Any) -> None:
            if self._slot(partition).standby is not standby:  # stood down while it opened
                self._own.discard(connection)  # (forgotten already if still connecting then)
                abort_connection(connection)
                return
            connection.channel(
                on_open_callback=lambda ch: self._standby_open(partition, ch, standby)
            )

        def failed(connection: Any, error: BaseException) -> None:
            self._own.discard(connection)
            if standby.returning:  # given back while it opened: no standby is wanted
                self._standby_closed(partition, standby)
                return
            # the same one line as the member's own connection (a node killed, TLS, a
            # password), not pika's repr of its wrappers
            why = unavailable(self.where, error)
            log.warning("partition %d: cannot connect its standby: %s", partition, why)
            main.ioloop.call_later(_STANDBY_RETRY, lambda: self._standby_closed(partition, standby))

        def closed(connection: Any, reason: BaseException) -> None:
            if connection in self._own and not standby.returning:  # not aborted by us
                log.warning("partition %d: its standby's connection closed: %r", partition, reason)
            self._own.discard(connection)
            if standby.channel is None:  # else its channel's close callback said it
                self._standby_closed(partition, standby)

        standby.connection = self.connect(main, opened, failed, closed)
        self._own.add(standby.connection)

    def _not_beside_own(self, partition: int) -> None:
        """A standby asked for while the partition's own subscription is still there: say it
        is lost a little later, so that the controller asks again if it still wants one
        (skipped in silence, it would think us standing with nothing at the broker)."""
        log.info("partition %d: not standing by beside its own subscription yet", partition)

        def again() -> None:
            if self._slot(partition).standby is None:
                self.sink(StandbyLost(partition))

        self.connection.ioloop.call_later(_STANDBY_RETRY, again)

    def _standby_open(self, partition: int, channel: Channel, standby: _Standby) -> None:
        if self._slot(partition).standby is not standby:  # stood down while it opened
            self._end_own(channel.connection)
            return
        standby.channel = channel
        channel.add_on_close_callback(lambda _ch, _reason: self._standby_closed(partition, standby))

        def on_delivery(method_frame: Any, header_frame: Any, body: bytes) -> None:
            method = method_frame.method
            delivery = Delivery.of(partition, channel, method, header_frame, body, 0)
            standby.buffer.append(delivery)  # given back: returned by the connection's abort
            if not standby.activated and not standby.returning:
                standby.activated = True
                self.sink(Activated(partition))

        channel._on_deliver = on_delivery
        queue = self.spec.queue(partition)

        def consume_behind(frame: Any) -> None:
            """Subscribe only behind a consumer: first, we would be the active one."""
            if not channel.is_open or standby.returning:
                return
            if frame.method.consumer_count < 1:
                self.connection.ioloop.call_later(_STANDBY_RECHECK, check)
                return
            standby.tag = channel.basic_consume(queue, lambda *_: None, arguments=standby.arguments)

        def check() -> None:
            if channel.is_open and not standby.returning and standby.tag is None:
                channel.queue_declare(queue, passive=True, callback=consume_behind)

        channel.basic_qos(prefetch_count=self.prefetch, callback=lambda _f: check())

    def _standby_closed(self, partition: int, standby: _Standby) -> None:
        """The standby's channel or connection closed (or could not open)."""
        self._end_own(standby.connection)  # (a channel closed by the broker: the rest too)
        slot = self._slot(partition)
        if slot.standby is standby:
            slot.standby = None
            self.sink(StandbyLost(partition))
        if slot.returning is standby:  # given back: all it was sent is back in the queue
            slot.returning = None
            if standby.then is not None:
                standby.then()
            elif slot.standby is None:  # so that the partition stands by again if wanted
                self.sink(StandbyLost(partition))

    def stand_down(self, partition: int) -> None:
        standby = self._slot(partition).standby
        if standby is not None and not standby.activated:
            self.give_back(partition)

    def give_back(self, partition: int) -> None:
        """End the standby by aborting its connection's socket: the queue returns what it
        was sent, in order, before it serves any other consumer (the module docstring says
        why not ``basic.cancel``). A subscribe of the partition meanwhile waits for that
        connection's close (:meth:`subscribe`): a new consumer beside the standby would be
        activated by nothing sooner, but would see the returns only once RabbitMQ notices
        the standby's end."""
        slot = self._slot(partition)
        standby, slot.standby = slot.standby, None
        if standby is None:
            return
        standby.returning = True
        if standby.channel is not None and standby.channel.is_open:
            slot.returning = standby  # until _standby_closed: then, or StandbyLost
        connection = standby.connection
        if connection is not None and not (connection.is_open or connection.is_closed):
            # Still opening: nothing was sent to it, and its open ends it (``opened``). An
            # abort in the AMQP handshake would make pika log three errors for it.
            return
        self._end_own(connection)

    def _adopt(self, partition: int, generation: int, arguments: Arguments) -> bool:
        """Make the partition's standby subscription its subscription (the claim is ours
        now): it keeps its place in the queue's line, behind the last owner's consumer until
        that one goes, and what it was sent so far goes to the worker; nothing is given back.
        False if there is none that can be (still opening, not consuming yet, given back,
        closed, or an heir's of another priority): that one is given back, and the caller
        subscribes anew.

        Decided here, on the I/O thread, because only here is it known whether the broker
        has activated it: a give-back of an activated standby races the deliveries still in
        flight to it, and a new consumer subscribed beside it is served newer messages
        before they are returned (seen: a planned move to a partition's own standby,
        RabbitMQ 3.10)."""
        slot = self._slot(partition)
        standby = slot.standby
        if standby is None:
            return False
        channel = standby.channel
        if (
            channel is None
            or not channel.is_open
            or standby.tag is None
            or standby.returning
            or rank(standby.arguments) != rank(arguments)
        ):
            self.give_back(partition)
            return False
        slot.arguments = arguments
        self.promote(partition, generation)
        self._subscribed(partition)  # its basic.consume-ok came when it stood by
        return True

    def promote(self, partition: int, generation: int) -> None:
        slot = self._slot(partition)
        standby, slot.standby = slot.standby, None
        if standby is None or standby.channel is None or not standby.channel.is_open:
            self.sink(ChannelLost(partition))
            return
        # A channel warming for the claim we were waiting for (the leader gave us the
        # partition before RabbitMQ activated us) must not become the partition's
        # subscription once warm: the worker's acks for the promoted channel would be
        # dropped as an old channel's, and no delivery would come past the prefetch.
        warm = slot.sub
        if warm is not None and warm.tag is None and warm.channel.is_open:
            warm.channel.close()  # warm, never consumed on: nothing to return
        channel = standby.channel
        window = self._window(partition, received=len(standby.buffer))
        sub = _Sub(channel, window, generation, tag=standby.tag)
        slot.line = sub
        self._watch(partition, channel)
        self._route(partition, sub)
        for delivery in standby.buffer:
            sub.unacked.append(delivery.delivery_tag)
            if delivery.exchange == self.fillers.exchange:  # a filler: as on the route
                self._feed(partition, sub, w.Acked((delivery.delivery_tag,)))
            else:
                self.sink(dataclasses.replace(delivery, generation=generation))
        standby.buffer.clear()
