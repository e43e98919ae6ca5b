"""One connection's partition channels: a slot per partition, its drain run by the pure window.

Threads. Everything here runs on the broker's pika I/O thread
(``partq.consumers.broker.connection`` calls
it from its loop's callbacks, and pika calls the channel callbacks set here), so nothing is
locked. What it learns goes out through the broker's sink (``partq.consumers.broker.port``):
deliveries
and END for the workers, the rest for the controller.

:class:`Channels` keeps a slot per partition (``partq.consumers.broker.slots`` says what
one holds), and here opens, warms and consumes on the partitions' channels and watches
them close. Two parts of it live beside it: the drain (``partq.consumers.broker.drain``:
the window decides it, ``partq.consumers.state.window`` says why each step is safe, and
that part only carries out its actions on pika) and the hot standbys
(``partq.consumers.broker.hotstandby``, on connections of their own). A drained channel
is *parked*, not closed (a close right after the last acks could return messages whose
settles the quorum queue has not applied yet), reused if the partition comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from partq.consumers.broker.drain import Draining
from partq.consumers.broker.fillers import Fillers
from partq.consumers.broker.hotstandby import Connect, HotStandby, select_connection
from partq.consumers.broker.port import (
    ChannelLost,
    Delivery,
    Refused,
    Sink,
    StandbyLost,
    Subscribed,
)
from partq.consumers.broker.slots import _Opening, _Slot, _Sub, _Warm
from partq.consumers.state import window as w
from partq.consumers.state.priority import Arguments
from partq.producer.contract import StreamSpec
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL, access_refused
from partq.kernel.backoff import Backoff

__all__ = ["Channels"]

log = logging.getLogger("partq.consumer.broker")
_BACKOFF = Backoff()  # subscribes to a missing queue: 0.2 s doubling to 5 s
_DELIVERED = w.Delivered()


class Channels(HotStandby, Draining):
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
