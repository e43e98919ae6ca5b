"""The broker's channels over fake pika objects: acks, drains called off, standbys promoted.

Driven only through :class:`partq.consumers.broker.channels.Channels`' methods (as the broker's I/O
loop
calls them) and the pika callbacks it registers; the real thing is proven against RabbitMQ
by tests/integration/test_broker_drain.py.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace
from typing import Any

import pika.exceptions
import pytest
from partq.consumers.broker.acks import AckQueue
from partq.consumers.broker.channels import Channels
from partq.consumers.broker.port import (
    Activated,
    BrokerEvent,
    ChannelLost,
    Delivery,
    Drained,
    Emptied,
    End,
    Kept,
    StandbyLost,
    Subscribed,
)
from partq.producer.contract import StreamSpec, queue_name

PREFETCH = 4
SPEC = StreamSpec("orders", 4)
FILLER = (SPEC.dead_letter_exchange, SPEC.queue(0))  # a filler of partition 0: its route


class Channel:
    """A pika channel whose round trips answer on the loop's next turn (``Loop.settle``),
    unless ``manual``: then the test runs the queued ``basic_qos`` callbacks itself."""

    def __init__(self, loop: Loop, *, manual: bool = False, connection: Any = None) -> None:
        self.loop = loop
        self.connection = connection
        self.is_open = True
        self.manual = manual
        self.acks: list[tuple[int, bool]] = []
        self.qos: list[Any] = []
        self.cancelled: list[str] = []
        self.nacked: list[int] = []
        self.consumers = 1  # consumers on its queue (a standby consumes behind one)
        self.published: list[tuple[str, str]] = []  # (exchange, routing key)
        self._returners: list[Any] = []
        self._closers: list[Any] = []
        self._tags = itertools.count(1)

    def add_on_close_callback(self, callback: Any) -> None:
        self._closers.append(callback)

    def add_on_cancel_callback(self, _callback: Any) -> None:
        return None

    def add_on_return_callback(self, callback: Any) -> None:
        self._returners.append(callback)

    def basic_publish(
        self, exchange: str, routing_key: str, _body: bytes, _properties: Any, mandatory: bool
    ) -> None:
        assert mandatory
        self.published.append((exchange, routing_key))

    def return_all(self) -> None:
        """RabbitMQ returns every message published on this channel: unroutable."""
        for exchange, routing_key in self.published:
            method = SimpleNamespace(exchange=exchange, routing_key=routing_key)
            for returner in self._returners:
                returner(self, method, None, b"")

    def basic_qos(self, prefetch_count: int, callback: Any) -> None:
        if self.manual:
            self.qos.append(callback)
        else:
            self.loop.soon(callback, None)

    def basic_consume(
        self, _queue: str, _unused: Any, callback: Any = None, arguments: Any = None
    ) -> str:
        if callback is not None:
            self.loop.soon(callback, None)
        return "ctag"

    def basic_cancel(self, tag: str, callback: Any) -> None:
        self.cancelled.append(tag)
        self.loop.soon(callback, None)

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.acks.append((delivery_tag, multiple))

    def basic_nack(self, delivery_tag: int, requeue: bool) -> None:
        self.nacked.append(delivery_tag)

    def queue_declare(self, _queue: str, passive: bool, callback: Any) -> None:
        counts = SimpleNamespace(message_count=0, consumer_count=self.consumers)
        self.loop.soon(callback, SimpleNamespace(method=counts))

    def close(self) -> None:
        self.is_open = False
        for closer in self._closers:
            closer(self, RuntimeError("closed"))

    def deliver(self, exchange: str = "partq.orders", routing_key: str = "0") -> int:
        """RabbitMQ delivers the next message on this channel; its tag."""
        tag = next(self._tags)
        method = SimpleNamespace(
            method=SimpleNamespace(
                delivery_tag=tag, redelivered=False, routing_key=routing_key, exchange=exchange
            )
        )
        self._on_deliver(method, SimpleNamespace(properties=None), b"")  # type: ignore[attr-defined]
        return tag


class Loop:
    """An I/O loop: replies run on ``settle``, timers when the test says."""

    def __init__(self) -> None:
        self.later: list[Any] = []
        self.replies: list[tuple[Any, Any]] = []

    def call_later(self, _delay: float, callback: Any) -> None:
        self.later.append(callback)

    def soon(self, callback: Any, frame: Any) -> None:
        self.replies.append((callback, frame))

    def settle(self) -> None:
        """Run the replies due, and those they cause, in order (bounded)."""
        for _ in range(1000):
            if not self.replies:
                return
            callback, frame = self.replies.pop(0)
            callback(frame)
        raise AssertionError("replies without end")


class Connection:
    """A pika connection whose channels open when the test says (``open_next``)."""

    def __init__(self) -> None:
        self.is_open = True
        self.ioloop = Loop()
        self.opening: list[Any] = []
        self.own: list[Connection] = []  # the standbys' connections opened beside it
        self._transport: Any = None  # (a standby's: its socket, for abort_connection)

    def channel(self, on_open_callback: Any) -> None:
        self.opening.append((self, on_open_callback))

    def open_next(self, *, manual: bool = False) -> Channel:
        """Open the next channel asked for, on this connection or one opened beside it."""
        connection, on_open = self.opening.pop(0)
        channel = Channel(self.ioloop, manual=manual, connection=connection)
        on_open(channel)
        self.ioloop.settle()
        return channel


class Socket:
    """A connection's socket: records its shutdown (``abort_connection``)."""

    def __init__(self) -> None:
        self.shut: list[int] = []

    def shutdown(self, how: int) -> None:
        self.shut.append(how)


def connect_beside(main: Connection, on_open: Any, _failed: Any, _closed: Any) -> Connection:
    """A standby's own connection, open on the loop's next turn; its channels open from
    ``main``'s queue (``open_next``)."""
    own = Connection()
    own.is_open, own.is_closed = False, False
    own.ioloop = main.ioloop
    own.opening = main.opening
    own._transport = SimpleNamespace(_sock=Socket())

    def opened(_frame: Any) -> None:
        own.is_open = True
        on_open(own)

    main.ioloop.soon(opened, None)
    main.own.append(own)
    return own


class Edge:
    """Channels on a fake connection, with every event they report."""

    def __init__(self, *, early: bool = False) -> None:
        self.events: list[BrokerEvent] = []
        self.channels = Channels(
            "amqp://guest:guest@127.0.0.1:1/%2F",
            SPEC,
            prefetch=PREFETCH,
            early=early,
            sink=self.events.append,
            connect=connect_beside,
        )
        self.connection = Connection()
        self.channels.attach(self.connection)

    def subscribed(self, partition: int, generation: int = 1) -> Channel:
        self.channels.subscribe(partition, generation)
        return self.connection.open_next()

    def settle(self) -> None:
        self.connection.ioloop.settle()


def test_the_oldest_unacked_in_order_go_as_one_multiple_ack() -> None:
    # Given two partitions with deliveries 1-3 and 1-2 on their channels
    edge = Edge()
    one, two = edge.subscribed(0), edge.subscribed(1)
    for _ in range(3):
        one.deliver()
    two.deliver(), two.deliver()
    # When their workers ack 1-3 and 1-2, interleaved, before the I/O loop runs
    acks = AckQueue()
    for partition, channel, tag in [
        (0, one, 1),
        (0, one, 2),
        (1, two, 1),
        (0, one, 3),
        (1, two, 2),
    ]:
        acks.put(partition, channel, tag)  # type: ignore[arg-type]
    for partition, channel, tags in acks.take():
        edge.channels.ack(partition, channel, tags)
    # Then each channel's acks went as one multiple ack
    assert one.acks == [(3, True)]
    assert two.acks == [(2, True)]


def test_a_gap_is_acked_tag_by_tag_so_the_skipped_delivery_stays_unacked() -> None:
    # Given deliveries 1-4, of which the worker acks 2 and 3 but not 1
    edge = Edge()
    channel = edge.subscribed(0)
    for _ in range(4):
        channel.deliver()
    edge.channels.ack(0, channel, [2, 3])  # type: ignore[arg-type]
    # Then no multiple ack covers 1: each is acked alone
    assert channel.acks == [(2, False), (3, False)]
    # and 1 stays unacked: once the worker acks 1 and 4, the only two left, one multiple
    edge.channels.ack(0, channel, [1, 4])  # type: ignore[arg-type]
    assert channel.acks[2:] == [(4, True)]


def test_acks_of_a_draining_partition_are_held_and_of_an_old_channel_dropped() -> None:
    edge = Edge()
    channel = edge.subscribed(0)
    for _ in range(3):
        channel.deliver()
    edge.channels.revoke(0)
    old = Channel(edge.connection.ioloop)
    edge.channels.ack(0, channel, [1, 2])  # type: ignore[arg-type]
    edge.channels.ack(0, old, [7])  # type: ignore[arg-type]
    assert channel.acks == [] and old.acks == []


def test_a_send_queued_on_a_dead_connection_does_not_stop_later_acks() -> None:
    # Given an ack whose send was scheduled (on a loop that then died unrun)
    acks = AckQueue()
    assert acks.put(0, "c1", 1)  # type: ignore[arg-type]
    assert not acks.put(0, "c1", 2)  # type: ignore[arg-type]  # one send already scheduled
    # When the connection's acks are dropped (as run() does once its loop has stopped)
    acks.drop()
    # Then the next ack schedules a send again, and carries only itself
    assert acks.put(0, "c2", 1)  # type: ignore[arg-type]
    assert acks.take() == [(0, "c2", [1])]


def test_a_full_window_of_a_drain_is_cancelled_and_ends_after_its_deliveries() -> None:
    # Given a partition with 2 of its 4 deliveries in flight to the worker, draining
    edge = Edge()
    channel = edge.subscribed(0, generation=3)
    channel.deliver(), channel.deliver()
    edge.channels.revoke(0)
    # When the window fills
    channel.deliver(), channel.deliver()
    edge.settle()
    # Then basic.cancel went, and END follows the last delivery, of the same generation
    assert channel.cancelled == ["ctag"]
    assert isinstance(edge.events[-1], End) and edge.events[-1].generation == 3
    assert [e.generation for e in edge.events if isinstance(e, Delivery)] == [3, 3, 3, 3]
    # When the worker has acked all four (held) and finishes
    edge.channels.ack(0, channel, [1, 2, 3, 4])  # type: ignore[arg-type]
    assert channel.acks == []
    edge.channels.finish(0, channel)  # type: ignore[arg-type]
    edge.settle()
    # Then the held acks go, one each, and the partition is drained
    assert channel.acks == [(1, False), (2, False), (3, False), (4, False)]
    assert edge.events[-1] == Drained(0)


def test_an_early_drain_is_emptied_once_all_is_handled_then_cut() -> None:
    edge = Edge(early=True)
    channel = edge.subscribed(0)
    for _ in range(PREFETCH):
        channel.deliver()
    edge.channels.revoke(0)  # full already: nothing can be in flight
    edge.channels.ack(0, channel, [1, 2, 3])  # type: ignore[arg-type]
    assert Emptied(0) not in edge.events  # one is still being handled
    edge.channels.ack(0, channel, [4])  # type: ignore[arg-type]
    assert edge.events[-1] == Emptied(0) and channel.cancelled == []
    edge.channels.cut(0)
    edge.settle()
    assert channel.cancelled == ["ctag"] and len(channel.acks) == 4
    assert edge.events[-1] == Drained(0)


def test_a_channel_warming_while_a_standby_is_promoted_does_not_take_its_acks() -> None:
    # Given partition 1 assigned to us before its owner's death reached us: its channel
    # warms (open, basic.qos under way) while our standby on it holds a delivery
    edge = Edge()
    edge.channels.warm(1)
    warm = edge.connection.open_next(manual=True)
    edge.channels.stand_by(1)
    edge.settle()  # its own connection opens
    standby = edge.connection.open_next()
    tag = standby.deliver()
    assert edge.events == [Activated(1)]
    # When the standby is promoted (a takeover) and then the warm channel's qos completes
    edge.channels.promote(1, generation=5)
    warm.qos.pop()(None)
    # Then the worker got the standby's delivery, of its generation, and its ack reaches
    # RabbitMQ; the warm channel, never consumed on, is closed
    handed = [e for e in edge.events if isinstance(e, Delivery)]
    assert [(d.delivery_tag, d.channel, d.generation) for d in handed] == [(tag, standby, 5)]
    edge.channels.ack(1, standby, [tag])  # type: ignore[arg-type]
    assert standby.acks == [(tag, False)]
    assert not warm.is_open


def test_a_promoted_standbys_fillers_are_acked_and_never_reach_the_worker() -> None:
    # Given a standby of partition 0 activated with a message, a filler (the old owner's
    # drain left it in the queue) and a message
    edge = Edge()
    edge.channels.stand_by(0)
    edge.settle()
    standby = edge.connection.open_next()
    first, filler, last = standby.deliver(), standby.deliver(*FILLER), standby.deliver()
    # When it is promoted (a takeover)
    edge.channels.promote(0, generation=2)
    # Then the worker gets the two messages; the filler is acked without it
    handed = [e.delivery_tag for e in edge.events if isinstance(e, Delivery)]
    assert handed == [first, last] and standby.acks == [(filler, False)]


def test_a_drain_whose_connection_dies_before_its_drained_report_is_reported_lost() -> None:
    # Given an early drain emptied and cut: CancelOk came and the held acks went, and the
    # drained report waits for its round trip (basic.qos)
    edge = Edge(early=True)
    edge.channels.subscribe(0, 1)
    channel = edge.connection.open_next(manual=True)
    channel.qos.pop()(None)  # its prefetch set: it consumes
    edge.settle()
    for _ in range(PREFETCH):
        channel.deliver()
    edge.channels.revoke(0)
    edge.channels.ack(0, channel, list(range(1, PREFETCH + 1)))  # type: ignore[arg-type]
    assert edge.events[-1] == Emptied(0)
    edge.channels.cut(0)
    edge.settle()
    assert len(channel.acks) == PREFETCH and Drained(0) not in edge.events and channel.qos
    # When the connection dies before the round trip's reply (a RabbitMQ node killed)
    edge.connection.is_open = False
    edge.channels.reset()
    # Then the partition is reported lost: its drain ends (else it waited for ever)
    assert edge.events[-1] == ChannelLost(0)


def test_a_standby_asked_beside_the_partitions_own_subscription_is_reported_lost() -> None:
    # Given partition 0's own subscription still opening (a subscribe not yet confirmed)
    edge = Edge()
    edge.channels.subscribe(0, 1)
    # When a standby of it is asked for (the controller thinks it idle)
    edge.channels.stand_by(0)
    # Then none is opened beside it, and a moment later it is reported lost, so that the
    # controller asks again rather than think it standing with nothing at the broker
    assert edge.connection.own == [] and StandbyLost(0) not in edge.events
    for later in edge.connection.ioloop.later:
        later()
    assert edge.events.count(StandbyLost(0)) == 1


def test_calls_that_reach_the_loop_after_the_connection_closed_open_nothing() -> None:
    # Given a subscribe, a warm and a standby asked while the connection was open, carried
    # out by the I/O loop after it closed (a RabbitMQ node died meanwhile: seen in a fault
    # soak, where pika's "Channel allocation requires an open connection" killed the loop)
    edge = Edge()
    edge.connection.is_open = False
    edge.channels.subscribe(0, 1)
    edge.channels.warm(1)
    edge.channels.stand_by(2)
    # Then nothing is opened, and only the standby is reported lost (the subscribing
    # partition is subscribed again by the reconnect)
    assert edge.connection.opening == [] and edge.events == [StandbyLost(2)]


def test_a_drain_called_off_before_its_cancel_sends_its_held_acks_and_consumes_on() -> None:
    # Given partition 0 draining (acks held) with 3 deliveries handled, its window not full
    edge = Edge()
    channel = edge.subscribed(0)
    for _ in range(3):
        channel.deliver()
    edge.channels.revoke(0)
    edge.channels.ack(0, channel, [1, 2, 3])  # type: ignore[arg-type]
    assert channel.acks == []
    # When it is called off (assigned back to us)
    edge.channels.resume(0)
    # Then the held acks go, as one multiple ack, it is reported kept, and acks flow again
    assert channel.acks == [(3, True)] and edge.events[-1] == Kept(0)
    channel.deliver()
    edge.channels.ack(0, channel, [4])  # type: ignore[arg-type]
    assert channel.acks[-1] == (4, False)
    # and the called-off drain's quiet timer cancels nothing
    for timer in edge.connection.ioloop.later:
        timer()
    assert channel.cancelled == []


def test_a_drain_fills_its_window_with_fillers_as_it_begins_and_cancels_once_full() -> None:
    # Given a drain of partition 0 with one delivery of PREFETCH
    edge = Edge()
    channel = edge.subscribed(0)
    channel.deliver()
    # When it begins to drain
    edge.channels.revoke(0)
    fillers = edge.connection.open_next()  # the fillers' own channel
    # Then its credit goes as fillers into its own queue, through the dead-letter exchange,
    # on a channel of their own; nothing is cancelled yet
    assert fillers.published == [FILLER] * (PREFETCH - 1)
    assert channel.published == [] and channel.cancelled == []
    # and the fillers' deliveries fill the window: the full window's cancel
    for _ in range(PREFETCH - 1):
        channel.deliver(*FILLER)
    edge.settle()
    assert channel.cancelled == ["ctag"]
    assert isinstance(edge.events[-1], End)
    # which the worker never sees: it handled the one message, and its finish sends the
    # held acks, the fillers' with its own
    assert [e.delivery_tag for e in edge.events if isinstance(e, Delivery)] == [1]
    edge.channels.ack(0, channel, [1])  # type: ignore[arg-type]
    edge.channels.finish(0, channel)  # type: ignore[arg-type]
    edge.settle()
    assert sorted(tag for tag, _multiple in channel.acks) == [1, 2, 3, 4]
    assert Drained(0) in edge.events


def test_fillers_reach_a_partition_a_resize_added_beyond_the_first_spec() -> None:
    # Given channels made for 4 partitions, widened by a grow (seen in CI: the fillers of
    # partition 10 of a stream begun with 6 raised in pika's callback, which dropped the
    # whole connection, twice, and left a retired queue with an unacked fence)
    edge = Edge()
    edge.channels.spec = StreamSpec("orders", 12)
    # When partition 10's drain fills / Then its fillers go to its queue
    edge.channels.fillers.publish(edge.connection, 10, 1, 2)
    fillers = edge.connection.open_next()
    assert fillers.published == [(SPEC.dead_letter_exchange, queue_name("orders", 10))] * 2


def test_a_queue_that_returns_its_fillers_is_drained_by_the_quiet_cancel_from_then_on() -> None:
    # Given a stream whose queues are not bound to the dead-letter exchange (partq 0.2.0)
    edge = Edge()
    channel = edge.subscribed(0)
    channel.deliver()
    edge.channels.revoke(0)
    fillers = edge.connection.open_next()
    # When RabbitMQ returns the fillers / Then the drain cancels as it did before fillers
    fillers.return_all()
    edge.connection.ioloop.later.pop()()  # the Unfilled, fed on the loop's next turn
    edge.settle()
    assert channel.cancelled == ["ctag"]
    # and the partition's next subscription's drain does not fill: it asks the queue
    edge.channels.finish(0, channel)
    edge.settle()
    edge.channels.subscribe(0, 2)
    edge.settle()
    edge.channels.revoke(0)
    edge.connection.ioloop.later.pop()()
    edge.settle()
    assert channel.cancelled == ["ctag", "ctag"] and fillers.published == [FILLER] * (PREFETCH - 1)


def test_a_drain_whose_cancel_was_sent_is_not_called_off() -> None:
    edge = Edge()
    channel = edge.subscribed(0)
    for _ in range(PREFETCH):
        channel.deliver()
    edge.channels.revoke(0)  # full: cancelled at once
    edge.settle()
    edge.channels.resume(0)
    assert Kept(0) not in edge.events and channel.cancelled == ["ctag"]


def test_subscribed_is_reported_and_a_subscribe_while_opening_takes_the_newer_generation() -> None:
    edge = Edge()
    edge.channels.subscribe(0, 1)
    edge.channels.subscribe(0, 2)  # the same channel still opening
    channel = edge.connection.open_next()
    assert edge.connection.opening == []
    channel.deliver()
    assert edge.events[0] == Subscribed(0)
    assert [e.generation for e in edge.events if isinstance(e, Delivery)] == [2]


def test_a_standby_whose_connection_fails_says_why_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a member connected to a node, and a standby of partition 2 whose own
    # connection to that node is refused (the node was killed meanwhile)
    edge = Edge()
    edge.channels.attach(edge.connection, "amqp://guest:secret@127.0.0.1:5999/%2F")
    refused = pika.exceptions.AMQPConnectionError(ConnectionRefusedError(111, "refused"))

    def connect_refused(main: Connection, _open: Any, failed: Any, _closed: Any) -> Connection:
        own = Connection()
        main.ioloop.soon(lambda _f: failed(own, refused), None)
        return own

    edge.channels.connect = connect_refused
    # When it tries to stand by
    with caplog.at_level(logging.WARNING, logger="partq"):
        edge.channels.stand_by(2)
        edge.settle()
    # Then the warning is the member's own one line for that node (no password, no
    # pika repr), and nothing is reported lost yet (the standby is retried later)
    (line,) = [r.getMessage() for r in caplog.records if "standby" in r.getMessage()]
    assert line.startswith("partition 2: cannot connect its standby: cannot reach RabbitMQ at")
    assert "127.0.0.1:5999" in line and "secret" not in line and "AMQPConnectionError(" not in line
    assert edge.events == []


def test_a_standby_given_back_while_its_connection_opens_is_ended_once_open() -> None:
    # Given a standby of partition 2 whose own connection is still opening (AMQP handshake)
    edge = Edge()
    edge.channels.stand_by(2)
    (own,) = edge.connection.own
    assert not own.is_open
    # When it is given back, its socket is left alone (an abort in the handshake makes pika
    # log errors for a connection partq itself ended)
    edge.channels.give_back(2)
    assert own._transport._sock.shut == []
    # Then once open it is aborted, with no channel opened on it and nothing reported lost
    edge.settle()
    assert own._transport._sock.shut and edge.connection.opening == []
    assert edge.events == []


def test_a_standby_is_given_back_by_aborting_its_own_connection_never_by_a_cancel() -> None:
    # Given a standby of partition 2, on a connection of its own, activated by RabbitMQ
    # with two deliveries
    edge = Edge()
    edge.channels.stand_by(2)
    edge.settle()
    standby = edge.connection.open_next()
    standby.deliver()
    standby.deliver()
    (own,) = edge.connection.own
    assert standby.connection is own and edge.events == [Activated(2)]
    # When it is given back
    edge.channels.give_back(2)
    # Then its connection's socket is shut (RabbitMQ returns all it held, in order), and
    # nothing is cancelled or returned one by one (a delivery in flight at a cancel would
    # come back ahead of those)
    assert own._transport._sock.shut and standby.cancelled == [] and standby.nacked == []
    # and once its channel closes, a subscribe of the partition may follow
    standby.close()
    assert edge.events[-1] == StandbyLost(2)
