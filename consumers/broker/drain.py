"""The drain of a partition's subscription: feed its window, carry out its actions on pika.

:class:`Draining` is a part of :class:`partq.consumers.broker.channels.Channels`: the
controller's revoke, resume, cut and finish and the workers' acks go to the subscription's
:class:`partq.consumers.state.window.Window` as events, and its actions (acks, the cancel,
fillers, END, the reports) are carried out here. The window decides the drain
(``partq.consumers.state.window`` says why each step is safe); this module only carries
out its actions.

Threads. Everything here runs on the broker's pika I/O thread, like the rest of
``Channels``, so nothing is locked.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from partq.consumers.broker.acks import send
from partq.consumers.broker.fillers import Fillers
from partq.consumers.broker.port import ChannelLost, Drained, Emptied, End, Kept, Sink
from partq.consumers.broker.slots import _Slot, _Sub
from partq.consumers.state import window as w
from partq.producer.contract import StreamSpec
from pika.channel import Channel

__all__ = ["Draining"]

log = logging.getLogger("partq.consumer.broker")


class Draining:
    """The drain's half of :class:`partq.consumers.broker.channels.Channels` (its state is
    set there)."""

    spec: StreamSpec
    prefetch: int
    sink: Sink
    connection: Any
    last_drain: float
    fillers: Fillers

    if TYPE_CHECKING:

        def _slot(self, partition: int) -> _Slot: ...

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
