"""The broker's batched acks: a multiple ack only ever covers what the worker acked."""

from __future__ import annotations

from typing import Any

from consumers.broker import Broker, Delivery, _Standby, _Subscription
from producer.contract import StreamSpec


class Channel:
    is_open = True

    def __init__(self) -> None:
        self.acks: list[tuple[int, bool]] = []

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.acks.append((delivery_tag, multiple))


def broker() -> Broker:
    def nothing(*_args: Any) -> None:
        return None

    return Broker(
        "amqp://guest:guest@127.0.0.1:1/%2F",
        StreamSpec("orders", 4),
        prefetch=100,
        heartbeat=5,
        name="test",
        deliver=nothing,
        on_subscribed=nothing,
        on_drained=nothing,
        on_channel_lost=nothing,
        on_connection=nothing,
    )


def subscribed(b: Broker, partition: int, delivered: list[int]) -> Channel:
    channel = Channel()
    sub = _Subscription(channel, consuming=True)  # type: ignore[arg-type]
    sub.unacked.extend(delivered)
    sub.received = len(delivered)
    b._subs[partition] = sub
    return channel


def test_the_oldest_unacked_in_order_go_as_one_multiple_ack() -> None:
    # Given two partitions with deliveries 1-5 and 1-3 on their channels
    b = broker()
    one, two = subscribed(b, 0, [1, 2, 3, 4, 5]), subscribed(b, 1, [1, 2, 3])
    # When their workers ack 1-3 and 1-2, interleaved, before the I/O loop runs
    for partition, channel, tag in [(0, one, 1), (0, one, 2), (1, two, 1), (0, one, 3)]:
        b._acks.append((partition, channel, tag))  # as Broker.ack queues them
    b._acks.append((1, two, 2))
    b._send_acks()
    # Then each channel's acks went as one multiple ack
    assert one.acks == [(3, True)]
    assert two.acks == [(2, True)]
    assert list(b._subs[0].unacked) == [4, 5] and b._subs[0].acks_sent == 3
    assert list(b._subs[1].unacked) == [3] and b._subs[1].acks_sent == 2


def test_a_gap_is_acked_tag_by_tag_so_the_skipped_delivery_stays_unacked() -> None:
    # Given deliveries 1-4, of which the worker acks 2 and 3 but not 1
    b = broker()
    channel = subscribed(b, 0, [1, 2, 3, 4])
    b._acks += [(0, channel, 2), (0, channel, 3)]  # type: ignore[list-item]
    b._send_acks()
    # Then no multiple ack covers 1: each is acked alone, and 1 stays unacked
    assert channel.acks == [(2, False), (3, False)]
    assert list(b._subs[0].unacked) == [1, 4]


def test_acks_of_a_draining_partition_are_held_and_of_an_old_channel_dropped() -> None:
    b = broker()
    channel = subscribed(b, 0, [1, 2, 3])
    b._subs[0].holding = True
    old = Channel()
    b._acks += [(0, channel, 1), (0, channel, 2), (0, old, 7)]  # type: ignore[list-item]
    b._send_acks()
    assert channel.acks == [] and old.acks == []
    assert b._subs[0].held == [1, 2]


def test_acks_queued_on_a_connection_that_died_do_not_stop_later_acks() -> None:
    # Given an ack whose send was queued on a connection's loop that then died unrun
    b = broker()
    sent: list[object] = []
    b._call = lambda fn: sent.append(fn) or True  # type: ignore[method-assign]
    channel = subscribed(b, 0, [1, 2])
    b.ack(0, channel, 1)  # type: ignore[arg-type]
    assert len(sent) == 1
    b._drop_acks()  # as run() does once the connection's loop has stopped
    # When the worker acks on the next connection's channel
    new_channel = subscribed(b, 0, [1])
    b.ack(0, new_channel, 1)  # type: ignore[arg-type]
    # Then a send is scheduled again, and it acks only the new channel's delivery
    assert len(sent) == 2
    b._send_acks()
    assert new_channel.acks == [(1, False)] and channel.acks == []


class OpeningChannel(Channel):
    """A channel whose callbacks the test runs by hand (the broker's round trips)."""

    def __init__(self) -> None:
        super().__init__()
        self.qos: list[Any] = []
        self.closed = False

    def add_on_close_callback(self, _callback: Any) -> None:
        return None

    def add_on_cancel_callback(self, _callback: Any) -> None:
        return None

    def basic_qos(self, prefetch_count: int, callback: Any) -> None:
        self.qos.append(callback)

    def close(self) -> None:
        self.closed = True
        self.is_open = False


class Connection:
    def __init__(self) -> None:
        self.opening: list[Any] = []
        self.is_open = True

    def channel(self, on_open_callback: Any) -> None:
        self.opening.append(on_open_callback)


def test_a_channel_warming_while_a_standby_is_promoted_does_not_take_its_acks() -> None:
    # Given partition 1 assigned to us before its owner's death reached us: its channel
    # warms (open, basic.qos under way) while our standby on it holds a delivery
    b = broker()
    delivered: list[Any] = []
    b._deliver = lambda _p, item: delivered.append(item)
    connection = Connection()
    b._connection = connection  # type: ignore[assignment]
    b._warm(1)
    warm = OpeningChannel()
    connection.opening.pop()(warm)
    standby = OpeningChannel()
    delivery = Delivery(1, standby, 7, True, None, b"")  # type: ignore[arg-type]
    b._standbys[1] = _Standby(standby, tag="standby", buffer=[delivery], activated=True)  # type: ignore[arg-type]
    # When the standby is promoted (a takeover) and then the warm channel's qos completes
    b._promote(1)
    warm.qos.pop()(None)
    # Then the worker's ack of the standby's delivery reaches RabbitMQ, and the warm
    # channel, never consumed on, is closed
    assert delivered == [delivery]
    b._acks.append((1, standby, 7))  # type: ignore[arg-type]
    b._send_acks()
    assert standby.acks == [(7, False)]
    assert b._subs[1].channel is standby and warm.closed


class Loop:
    """An I/O loop whose timers the test runs by hand."""

    def __init__(self) -> None:
        self.later: list[Any] = []

    def call_later(self, _delay: float, callback: Any) -> None:
        self.later.append(callback)


def test_a_drain_called_off_before_its_cancel_sends_its_held_acks_and_consumes_on() -> None:
    # Given partition 0 draining (acks held) with 3 deliveries handled, its window not full
    b = broker()
    kept: list[int] = []
    b._on_kept = kept.append
    connection = Connection()
    connection.ioloop = Loop()  # type: ignore[attr-defined]
    b._connection = connection  # type: ignore[assignment]
    channel = subscribed(b, 0, [1, 2, 3])
    b._revoke(0)
    b._acks += [(0, channel, 1), (0, channel, 2), (0, channel, 3)]  # type: ignore[list-item]
    b._send_acks()
    assert channel.acks == [] and b._subs[0].held == [1, 2, 3]
    # When it is called off (assigned back to us)
    b._resume(0)
    # Then the held acks go, as one multiple ack, it is reported kept, and acks flow again
    assert channel.acks == [(3, True)] and kept == [0]
    sub = b._subs[0]
    assert not sub.holding and not sub.cancel_sent and list(sub.unacked) == []
    sub.unacked.append(4)
    b._acks.append((0, channel, 4))  # type: ignore[arg-type]
    b._send_acks()
    assert channel.acks[-1] == (4, False)
    # and the called-off drain's quiet timer cancels nothing
    for timer in connection.ioloop.later:  # type: ignore[attr-defined]
        timer()
    assert not sub.cancel_sent


def test_a_drain_whose_cancel_was_sent_is_not_called_off() -> None:
    b = broker()
    kept: list[int] = []
    b._on_kept = kept.append
    subscribed(b, 0, [1])
    sub = b._subs[0]
    sub.holding, sub.cancel_sent = True, True
    b._resume(0)
    assert kept == [] and sub.holding
