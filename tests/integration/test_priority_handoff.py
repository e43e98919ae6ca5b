"""A planned handoff by consumer priority on RabbitMQ 4.0.5 quorum (consumers/priority.py):
the heir, subscribed above the owner, is served only once the owner has settled every
delivery, and then exactly what follows, in order, with nothing returned."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pika
import pytest

from consumers.broker import Broker
from consumers.port import BrokerEvent, ChannelLost, Delivery, Drained, End, Subscribed
from producer.contract import StreamSpec
from producer.publisher import Producer
from producer.topology import declare_stream, delete_stream
from tests.polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def spec(rabbitmq_40: str, stream_name: str) -> Iterator[StreamSpec]:
    spec = StreamSpec(stream_name, 1, "quorum")
    with pika.BlockingConnection(pika.URLParameters(rabbitmq_40)) as connection:
        declare_stream(connection, spec)
    yield spec
    with pika.BlockingConnection(pika.URLParameters(rabbitmq_40)) as connection:
        delete_stream(connection, spec)


class _Owner:
    """A Broker whose handler (a worker thread) takes ``pause`` seconds per message, so
    that it holds unsettled deliveries when the heir subscribes."""

    def __init__(self, url: str, spec: StreamSpec, name: str, pause: float) -> None:
        self.handled: list[tuple[float, int, bool]] = []  # (when, seq, redelivered)
        self.events: queue.Queue[tuple[str, int]] = queue.Queue()
        self.inbox: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()
        self.pause = pause
        self.on_first: list[object] = []
        self.broker = Broker(url, spec, prefetch=50, heartbeat=10, name=name, sink=self._sink)
        self.worker = threading.Thread(target=self._work, daemon=True)

    def _sink(self, event: BrokerEvent) -> None:
        match event:
            case End(partition, channel):
                self.broker.finish(partition, channel)
            case Delivery():
                self.inbox.put(event)
            case Subscribed(partition):
                self.events.put(("subscribed", partition))
            case Drained(partition):
                self.events.put(("drained", partition))
            case ChannelLost(partition):
                self.events.put(("lost", partition))

    def _work(self) -> None:
        while (delivery := self.inbox.get()) is not None:
            time.sleep(self.pause)
            self.handled.append((time.monotonic(), int(delivery.body), delivery.redelivered))
            self.broker.ack(0, delivery.channel, delivery.delivery_tag)

    def start(self) -> None:
        self.worker.start()
        self.broker.start()
        assert self.broker.connected.wait(15)

    def stop(self) -> None:
        self.inbox.put(None)
        self.broker.stop()
        self.broker.join(10)


def test_the_heir_above_the_owner_takes_over_once_the_owner_settled_all(
    spec: StreamSpec, rabbitmq_40: str
) -> None:
    # Given an owner (priority 0) handling a partition fed at ≈ 500 msg/s, slower than fed
    owner = _Owner(rabbitmq_40, spec, "prio-owner", pause=0.004)
    heir = _Owner(rabbitmq_40, spec, "prio-heir", pause=0.0)
    stop = threading.Event()
    published: list[int] = []

    def feed() -> None:
        with Producer(spec, amqp_url=rabbitmq_40) as producer:
            for seq in range(3000):
                if stop.is_set():
                    break
                producer.publish("k", str(seq))
                published.append(seq)
                if seq % 5 == 0:
                    time.sleep(0.01)
            producer.flush(30)

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        owner.start()
        heir.start()
        owner.broker.subscribe(0, 1, priority=0)
        feeder.start()
        wait_until(lambda: len(owner.handled) >= 200, 30, what="the owner handles")
        # When the heir subscribes with a higher priority while the owner holds deliveries
        heir.broker.subscribe(0, 1, priority=1)
        wait_until(lambda: heir.handled, 30, what="the broker switches to the heir")
        switched = heir.handled[0][0]
        owner.broker.cut(0)  # the owner's consumer waits now: cancelled, nothing returned
        stop.set()
        feeder.join(60)
        wait_until(
            lambda: len(owner.handled) + len(heir.handled) >= len(published), 60,
            what="everything handled",
        )  # fmt: skip
        drained = wait_until(
            lambda: ("drained", 0) in list(owner.events.queue), 15, what="the cut owner drained"
        )
        events = list(owner.events.queue) + list(heir.events.queue)  # before the stops
    finally:
        stop.set()
        owner.stop()
        heir.stop()
    assert drained
    # Then the owner handled a prefix and the heir exactly the rest, in order, none returned
    mine = [seq for _, seq, _ in owner.handled]
    theirs = [seq for _, seq, _ in heir.handled]
    assert mine + theirs == list(range(len(published)))
    assert not any(redelivered for *_, redelivered in owner.handled + heir.handled)
    # and the owner handled nothing once the heir was served (never two at once)
    assert max(when for when, _, _ in owner.handled) <= switched
    assert ("lost", 0) not in events
