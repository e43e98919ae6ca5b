"""One connection's partition channels: a slot per partition, its drain run by the pure window.

Threads. Everything here runs on the broker's pika I/O thread
(``partq.consumers.broker.connection`` calls
it from its loop's callbacks, and pika calls the channel callbacks set here), so nothing is
locked. What it learns goes out through the broker's sink (``partq.consumers.broker.port``):
deliveries
and END for the workers, the rest for the controller.

A partition's :class:`_Slot` holds its channel's line (:class:`_Opening`, :class:`_Warm`, or
a :class:`_Sub`: a channel and its :class:`partq.consumers.state.window.Window`), a subscribe
deferred
while its queue is missing, that queue's backoff, its ``basic.consume`` arguments and its
hot standby (:class:`_Standby`). The window decides the drain (``partq.consumers.state.window`` says
why each step is safe); this module only carries out its actions on pika. A drained channel
is *parked*, not closed (a close right after the last acks could return messages whose
settles the quorum queue has not applied yet), reused if the partition comes back.

A hot standby subscribes on a connection of its own, and ends by aborting that connection's
socket, never by ``basic.cancel``: RabbitMQ may have activated it (the owner's connection
died) and sent it deliveries, and one still on its way when a cancel is applied is returned
by the broker's channel at once, ahead of the older ones its client returns after
cancel-ok (seen on RabbitMQ 3.10: the newest delivery served first to the next consumer).
A dropped connection instead has the queue return everything its consumer held, in order,
before it serves any other consumer (docs/benchmarks.md, "Fencing"). A standby taken over
or adopted keeps its connection: it is the partition's subscription from then on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from partq.consumers.broker.acks import send
from partq.consumers.broker.fillers import Fillers
from partq.consumers.broker.port import (
    Activated,
    ChannelLost,
    Delivery,
    Drained,
    Emptied,
    End,
    Kept,
    Refused,
    Sink,
    StandbyLost,
    Subscribed,
)
from partq.consumers.state import window as w
from partq.consumers.state.priority import Arguments, rank
from partq.producer.contract import StreamSpec
from pika import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL, abort_connection, access_refused, unavailable
from partq.kernel.backoff import Backoff, Delays

__all__ = ["Channels"]

log = logging.getLogger("partq.consumer.broker")
_STANDBY_RECHECK = 0.2  # seconds between looks for the owner's consumer before standing by
_STANDBY_RETRY = 1.0  # seconds before a standby whose connection failed is reported lost
_BACKOFF = Backoff()  # subscribes to a missing queue: 0.2 s doubling to 5 s
_DELIVERED = w.Delivered()

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


@dataclass
class _Opening:
    """A channel opening for a subscribe."""

    generation: int


@dataclass
class _Warm:
    """A channel opening for ``warm``."""

    subscribe: int | None = None  # the generation of a subscribe asked meanwhile


@dataclass
class _Sub:
    """A channel with our prefetch: consumed on, draining, or parked (``window.phase``)."""

    channel: Channel
    window: w.Window
    generation: int = 0
    tag: str | None = None
    unacked: deque[int] = field(default_factory=deque)  # handed on, not acked: in order
    # the deliveries' pace, for the drain's quiet rule (partq.consumers.state.window.Pace): the last
    # one's monotonic time and the mean gap between them (an exponential average, 1/8 per delivery)
    last: float = field(default_factory=time.monotonic)
    gap: float = w.IDLE
    # a drain's end is reported after a round trip (``ReportDrained``): until then its
    # window is PARKED but the channel's loss is still the partition's, or that drain
    # never ends (seen in a soak: a node kill in that round trip, a partition idle 458 s)
    reporting: bool = False

    @property
    def live(self) -> bool:
        """Its channel's loss is the partition's: a live window, or a drain not yet reported."""
        return self.window.live or self.reporting

    @property
    def pace(self) -> w.Pace:
        return w.Pace(self.last, self.gap)


@dataclass
class _Standby:
    """A hot standby subscription, on its own connection: the queue's waiting consumer
    until the owner's goes. Deliveries (the broker activated it) are kept unhandled until
    the controller decides: ``promote`` (the owner died: they go to the worker), adopt it
    as the partition's subscription (the claim is ours: ``subscribe(adopt=True)``), or
    ``give_back`` (a planned move elsewhere: its connection is aborted, so that the queue
    returns them all, in order)."""

    connection: Any = None  # its own SelectConnection, on the broker's I/O loop
    channel: Channel | None = None  # None: opening
    tag: str | None = None
    buffer: list[Delivery] = field(default_factory=list)
    activated: bool = False
    returning: bool = False  # given back: its connection aborted, or to be once open
    then: Callable[[], None] | None = None  # a subscribe of the partition waiting for its close
    arguments: Arguments = None  # an heir's x-priority (partq.consumers.state.priority)


@dataclass
class _Slot:
    """Everything about one partition on this connection."""

    line: _Opening | _Warm | _Sub | None = None
    deferred: object | None = None  # the token of a subscribe waiting for its queue
    missing: tuple[float, Delays] | None = None  # its queue was NOT_FOUND: retry not before
    standby: _Standby | None = None
    returning: _Standby | None = None  # a standby being given back, until its channel closes
    arguments: Arguments = None  # basic.consume's

    def reset(self) -> None:
        """The connection is gone: only the missing queue's backoff outlives it."""
        self.line = self.deferred = self.standby = self.returning = None

    @property
    def sub(self) -> _Sub | None:
        return self.line if isinstance(self.line, _Sub) else None


class Channels:
    """The partitions' channels on the current connection (the module docstring)."""

    def __init__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        *,
        prefetch: int,
        early: bool,
        sink: Sink,
        connect: Connect = select_connection,
    ) -> None:
        self.url = url
        self.where: AmqpURL = url  # the node of the connection attached (``attach``)
        self.connect = connect
        self.spec = spec
        self.prefetch = prefetch
        self.early = early
        self.sink = sink
        self.connection: Any = None  # the SelectConnection (set by the broker's loop)
        self.last_drain = 0.0  # monotonic time of the last drain's acks
        self._slots: dict[int, _Slot] = {}
        self._fenced = False  # the connection is being aborted: open nothing more on it
        self._own: set[Any] = set()  # the standbys' connections (and those taken over)
        self.fillers = Fillers(spec, self._unfilled)

    def _window(
        self, partition: int, phase: w.Phase = w.Phase.CONSUMING, received: int = 0
    ) -> w.Window:
        """A new subscription's window (filled in a drain while its queue takes fillers)."""
        fill = self.fillers.usable_for(partition)
        return w.Window(self.prefetch, self.early, phase, received, fill=fill)

    def _slot(self, partition: int) -> _Slot:
        if (slot := self._slots.get(partition)) is None:
            slot = self._slots[partition] = _Slot()
        return slot

    def attach(self, connection: Any, where: AmqpURL | None = None) -> None:
        """A new connection (to node ``where`` of the URL): every slot starts empty on it."""
        self.connection = connection
        self.where = self.url if where is None else where
        self._fenced = False
        self.fillers.reset()

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

    def reset(self) -> None:
        """The connection died: report what was (being) subscribed lost, then standbys. The
        standbys' connections go too: the partitions on them are reported lost with the
        rest."""
        self._abort_own(loop_closed=True)
        lost, standbys = [], []
        for partition, slot in sorted(self._slots.items()):
            line = slot.line
            if (
                (isinstance(line, _Sub) and line.live)
                or isinstance(line, _Opening)
                or (isinstance(line, _Warm) and line.subscribe is not None)
                or slot.deferred is not None
            ):
                lost.append(partition)
            if slot.standby is not None:
                standbys.append(partition)
            slot.reset()
        for partition in lost:
            self.sink(ChannelLost(partition))
        for partition in standbys:
            self.sink(StandbyLost(partition))

    def fence(self) -> None:
        """Forget every partition, silently (``Broker.fence``)."""
        self._fenced = True
        self._abort_own()
        for slot in self._slots.values():
            slot.reset()

    # -- subscribing ---------------------------------------------------------------------

    def subscribe(
        self, partition: int, generation: int, arguments: Arguments = None, *, adopt: bool = False
    ) -> None:
        if not self.connection.is_open:  # closed since it was asked (a node died meanwhile):
            return  # the partition waits as subscribing, and the reconnect subscribes it
        slot = self._slot(partition)
        if adopt and self._adopt(partition, generation, arguments):
            return
        returning = slot.returning
        if returning is not None and returning.channel is not None and returning.channel.is_open:
            returning.then = self._later(partition, generation, arguments)  # once it is closed
            return
        slot.arguments = arguments
        retry_at = slot.missing[0] if slot.missing is not None else 0.0
        wait = retry_at - time.monotonic()
        if wait > 0:  # its queue was missing a moment ago: do not spin on NOT_FOUND
            self.connection.ioloop.call_later(wait, self._later(partition, generation, arguments))
            return
        line = slot.line
        if isinstance(line, _Warm):  # its channel is opening: consume once it is warm
            line.subscribe = generation
        elif isinstance(line, _Opening):
            line.generation = generation  # the newest worker gets what it brings
        elif isinstance(line, _Sub) and line.window.consuming:
            line.generation = generation  # already subscribed on this connection
        elif isinstance(line, _Sub) and line.channel.is_open:
            self._consume(partition, line.channel, generation, new=False)  # parked
        else:
            opening = slot.line = _Opening(generation)
            self.connection.channel(
                on_open_callback=lambda ch: self._opened(partition, ch, opening)
            )

    def _later(self, partition: int, generation: int, arguments: Arguments) -> Callable[[], None]:
        """A subscribe to make later (its queue missing a moment ago, or a standby of it
        being given back), unless revoked meanwhile or the connection is closing (``reset``
        then reports the partition lost)."""
        token = self._slot(partition).deferred = object()

        def later() -> None:
            slot = self._slot(partition)
            if slot.deferred is token and self.connection.is_open:
                slot.deferred = None
                self.subscribe(partition, generation, arguments)

        return later

    def _opened(self, partition: int, channel: Channel, opening: _Opening) -> None:
        if self._slot(partition).line is not opening:  # reset or replaced meanwhile
            if channel.is_open and not self._fenced:
                channel.close()
            return
        self._consume(partition, channel, opening.generation)

    def _consume(
        self, partition: int, channel: Channel, generation: int, *, new: bool = True
    ) -> None:
        """Consume on ``channel``; a parked or warm one (not ``new``) has its prefetch."""
        sub = _Sub(channel, self._window(partition), generation)
        self._slot(partition).line = sub
        if new:
            self._watch(partition, channel)
        self._route(partition, sub)

        def on_qos(_frame: Any) -> None:
            sub.tag = channel.basic_consume(
                self.spec.queue(partition),
                lambda *_: None,  # unused: on_delivery (_route) receives every delivery
                arguments=self._slot(partition).arguments,
                callback=lambda _f: self._subscribed(partition),
            )

        if new:
            channel.basic_qos(prefetch_count=self.prefetch, callback=on_qos)
        else:  # every channel is parked right after a basic.qos with our prefetch
            on_qos(None)

    def warm(self, partition: int) -> None:
        slot = self._slot(partition)
        if slot.line is not None or not self.connection.is_open:
            return
        warm = slot.line = _Warm()

        def ready(channel: Channel) -> None:
            slot = self._slot(partition)
            if slot.line is not warm:
                # reset (fence, reconnect, a standby promoted meanwhile): never consumed on
                if channel.is_open and not self._fenced:
                    channel.close()
                return
            if not channel.is_open:
                return  # closed: see closed()
            if warm.subscribe is not None:
                self._consume(partition, channel, warm.subscribe, new=False)
            else:  # parked, warm
                slot.line = _Sub(channel, self._window(partition, w.Phase.PARKED))

        def closed(_channel: Channel, _reason: BaseException) -> None:
            slot = self._slot(partition)
            if slot.line is warm:  # closed before it was warm
                slot.line = None
                if warm.subscribe is not None:
                    self.sink(ChannelLost(partition))

        def opened(channel: Channel) -> None:
            if self._slot(partition).line is not warm:
                channel.close()
                return
            channel.add_on_close_callback(closed)
            self._watch(partition, channel)
            channel.basic_qos(prefetch_count=self.prefetch, callback=lambda _f: ready(channel))

        self.connection.channel(on_open_callback=opened)

    def _watch(self, partition: int, channel: Channel) -> None:
        channel.add_on_close_callback(
            lambda ch, reason: self._channel_closed(partition, ch, reason)
        )
        # The broker cancels a consumer by itself when its queue is deleted: no END
        # would ever follow, so the partition is reported lost (its channel closed).
        channel.add_on_cancel_callback(lambda _frame: self._cancelled(partition, channel))

    def _route(self, partition: int, sub: _Sub) -> None:
        """Every delivery on the channel goes through the window, then to the worker (a
        drain's filler is acked here instead: ``partq.consumers.broker.fillers``). pika
        looks ``_on_deliver`` up on the instance for each delivery (pika 1.3 and 1.4), and
        its own would reject (requeue) those between basic.cancel and CancelOk;
        tests/integration/test_broker_drain.py pins the effect."""
        channel = sub.channel
        sink, filler = self.sink, self.fillers.exchange  # named once, not per delivery
        monotonic = time.monotonic

        def on_delivery(method_frame: Any, header_frame: Any, body: bytes) -> None:
            method = method_frame.method
            now = monotonic()
            sub.gap += (now - sub.last - sub.gap) * 0.125
            sub.last = now
            sub.window, actions = w.step(sub.window, _DELIVERED)
            for action in () if actions is w.HAND else actions:  # HAND: the per-message path
                if isinstance(action, w.Reject):  # no credit was left: never handle it here
                    log.error("partition %d: a delivery after the window was full", partition)
                    channel.basic_reject(method.delivery_tag, requeue=True)
                    return
                if not isinstance(action, w.HandOn):  # a full window's cancel, before it
                    self._do(partition, sub, action)
            sub.unacked.append(method.delivery_tag)
            if method.exchange == filler:  # a drain's filler: acked here, never handed on
                self._feed(partition, sub, w.Acked((method.delivery_tag,)))
                return
            sink(Delivery.of(partition, channel, method, header_frame, body, sub.generation))

        channel._on_deliver = on_delivery

    def _subscribed(self, partition: int) -> None:
        self._slot(partition).missing = None
        self.sink(Subscribed(partition))

    def _cancelled(self, partition: int, channel: Channel) -> None:
        log.warning("partition %d: RabbitMQ cancelled the consumer (queue deleted?)", partition)
        if channel.is_open:
            channel.close()  # -> _channel_closed -> ChannelLost

    def _channel_closed(self, partition: int, channel: Channel, reason: BaseException) -> None:
        slot = self._slot(partition)
        code = getattr(reason, "reply_code", None)
        if code == 404:  # NOT_FOUND: the queue does not exist
            delays = slot.missing[1] if slot.missing is not None else _BACKOFF.delays()
            slot.missing = (time.monotonic() + delays.next(), delays)
        self._end_own(channel.connection)  # a standby's, taken over: nothing else is on it
        sub = slot.sub
        if sub is None or sub.channel is not channel:
            return
        if self.connection is None or not self.connection.is_open:
            return  # the connection is going down: reset() reports every partition it had
        slot.line = None
        if code == 403:  # ACCESS_REFUSED: not lost, refused
            text = str(getattr(reason, "reply_text", reason))
            # basic.qos needs no permission: the consume does
            self.sink(Refused(partition, access_refused(self.url, text, "read")))
            return
        if sub.live:
            log.warning("partition %d: channel closed: %r", partition, reason)
            self.sink(ChannelLost(partition))

    # -- the drain: feed the window, carry out its actions -------------------------------

    def _current(self, partition: int, channel: Channel | None = None) -> _Sub | None:
        """The partition's open subscription (on ``channel``, if given)."""
        sub = self._slot(partition).sub
        if sub is None or not sub.channel.is_open:
            return None
        return sub if channel is None or sub.channel is channel else None

    def revoke(self, partition: int, *, waiting: bool = False) -> None:
        """Begin draining ``partition`` (``Broker.cancel``; ``waiting``: ``window.Revoke``)."""
        slot = self._slot(partition)
        slot.deferred = None
        sub = self._current(partition)
        if sub is None:
            self.sink(ChannelLost(partition))
        else:
            self._feed(partition, sub, w.Revoke(time.monotonic(), waiting, sub.pace))

    def resume(self, partition: int) -> None:
        sub = self._current(partition)
        if sub is not None:  # else gone: ChannelLost was (or will be) reported
            self._feed(partition, sub, w.Resume())

    def cut(self, partition: int) -> None:
        sub = self._current(partition)
        if sub is None:
            self.sink(ChannelLost(partition))
        else:
            self._feed(partition, sub, w.Cut())

    def finish(self, partition: int, channel: Channel) -> None:
        sub = self._current(partition, channel)
        if sub is None:
            self.sink(ChannelLost(partition))
        else:
            self._feed(partition, sub, w.Finish())

    def ack(self, partition: int, channel: Channel, tags: list[int]) -> None:
        """Ack ``tags`` (in the order the worker acked them) of one partition's channel."""
        sub = self._current(partition, channel)
        if sub is not None:  # else an old channel: the broker has requeued those already
            self._feed(partition, sub, w.Acked(tuple(tags)))

    def _feed(self, partition: int, sub: _Sub, event: w.WindowEvent) -> None:
        if not sub.channel.is_open:
            return  # closing: _channel_closed reports it
        sub.window, actions = w.step(sub.window, event)
        for action in actions:
            self._do(partition, sub, action)

    def _do(self, partition: int, sub: _Sub, action: w.Action) -> None:  # noqa: C901, PLR0912 — one case per action
        channel = sub.channel
        if not channel.is_open and not isinstance(action, w.REPORTS):
            return  # closing (a failed cancel, too): its close callback reports it lost
        match action:
            case w.Ack(tags):
                send(channel, sub.unacked, tags)
            case w.AckEach(tags):
                for tag in tags:
                    channel.basic_ack(tag)
            case w.Cancel(overdue):
                if overdue is not None:
                    log.warning(
                        "partition %d: cancelling after %.1fs with credit left (deliveries "
                        "still arrive, or the fillers did not fill the window); one in "
                        "flight is returned to the queue and may come back out of order",
                        partition,
                        overdue,
                    )
                self._cancel(partition, sub)
            case w.Fill(drain, count):
                self.fillers.publish(self.connection, partition, drain, count)
            case w.Barrier():
                channel.basic_qos(
                    prefetch_count=self.prefetch,
                    callback=lambda _f: self._feed(partition, sub, w.BarrierOk()),
                )
            case w.SendEnd():
                self.sink(End(partition, channel, sub.generation))
            case w.WaitQuiet(drain, seen):
                due = time.monotonic() + w.QUIET

                def quiet() -> None:
                    now = time.monotonic()
                    self._feed(partition, sub, w.Quiet(drain, seen, now, sub.pace, now - due))

                self.connection.ioloop.call_later(w.QUIET, quiet)
            case w.AskReady(drain, seen):
                channel.queue_declare(
                    self.spec.queue(partition),
                    passive=True,
                    callback=lambda frame: self._feed(
                        partition,
                        sub,
                        w.Ready(
                            drain, seen, frame.method.message_count, time.monotonic(), sub.pace
                        ),
                    ),
                )
            case w.ReportEmptied():
                self.sink(Emptied(partition))
            case w.ReportKept():
                self.sink(Kept(partition))
            case w.ReportDrained():
                sub.reporting = True
                channel.basic_qos(  # a round trip: the acks went first
                    prefetch_count=self.prefetch, callback=lambda _f: self._drained(partition, sub)
                )
            case w.ReportLost():
                self.sink(ChannelLost(partition))
            case w.HandOn() | w.Reject():
                raise AssertionError("only a delivery is handed on or rejected")

    def _cancel(self, partition: int, sub: _Sub) -> None:
        """``basic.cancel``; CancelOk goes to the window (no tag yet: nothing to cancel)."""
        if sub.tag is None:
            self._feed(partition, sub, w.CancelOk())
        else:
            sub.channel.basic_cancel(
                sub.tag, callback=lambda _f: self._feed(partition, sub, w.CancelOk())
            )

    def _unfilled(self, partition: int, drain: int) -> None:
        """Drain ``drain``'s fillers cannot reach ``partition``'s queue (``Fillers``)."""
        sub = self._current(partition)
        if sub is not None:
            self.connection.ioloop.call_later(
                0, lambda: self._feed(partition, sub, w.Unfilled(drain))
            )

    def _drained(self, partition: int, sub: _Sub) -> None:
        sub.reporting = False
        self.last_drain = time.monotonic()
        self.sink(Drained(partition))

    # -- hot standby ---------------------------------------------------------------------

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
