"""Planned handoffs of a trickling quorum partition: no drain's window fills by itself, so
each fills it with fillers (partq.consumers.broker.fillers) and cancels only once it is full;
per-key
order holds (examples.audit.order_violations), and the fillers never reach a handler.
Without fillers such a drain cancels with credit left, and on a 3.10 cluster a delivery in
flight at that cancel can come back late; one healthy node returns it in time, so order
alone cannot tell the two apart here: the fills counted can."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from partq.consumers.broker.connection import Broker
from partq.consumers.broker.port import BrokerEvent, Delivery, Drained, End
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer

from examples.audit import lost, order_violations
from tests.polling import wait_until

from .groups.harness import one_quorum_partition, record_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = [f"k{i}" for i in range(5)]


@pytest.fixture
def spec(rabbitmq: str, stream_name: str) -> Iterator[StreamSpec]:
    with one_quorum_partition(rabbitmq, stream_name) as spec:
        yield spec


def test_quiet_handoffs_of_a_trickle_keep_per_key_order(spec: StreamSpec, rabbitmq: str) -> None:
    # Given a partition fed at ≈ 8 msg/s in random gaps (quiet spells of 0.25 s are common)
    records: list[dict[str, Any]] = []
    published: list[tuple[str, int]] = []
    done = threading.Event()
    brokers: dict[str, Broker] = {}
    drained = {"A": threading.Event(), "B": threading.Event()}

    def feed() -> None:
        gaps = random.Random(19)
        with Producer(spec, amqp_url=rabbitmq) as producer:
            for n in range(200):
                key = KEYS[n % len(KEYS)]
                producer.publish(key, f"{key}:{n // len(KEYS)}")
                published.append((key, n // len(KEYS)))
                time.sleep(gaps.expovariate(8.0))
            producer.flush(30)
        done.set()

    def make(name: str, other: str) -> Broker:
        generations = iter(range(1, 1000))

        def sink(event: BrokerEvent) -> None:
            match event:
                case End(partition, channel):
                    brokers[name].finish(partition, channel)
                case Delivery():
                    records.append(record_of(event, name))
                    brokers[name].ack(event.partition, event.channel, event.delivery_tag)
                case Drained(partition):
                    drained[name].set()
                    # the next owner, once the drain is over
                    brokers[other].subscribe(partition, next(generations))

        return Broker(rabbitmq, spec, prefetch=100, heartbeat=10, name=f"quiet-{name}", sink=sink)

    brokers["A"], brokers["B"] = make("A", "B"), make("B", "A")
    for broker in brokers.values():
        broker.start()
        assert broker.connected.wait(15)
    feeder = threading.Thread(target=feed, daemon=True)
    handoffs = 0
    try:
        brokers["A"].subscribe(0, 1)
        feeder.start()
        owner = "A"
        # When the partition is moved back and forth, 0.2 s after each drain, while it trickles
        while not done.is_set() and handoffs < 40:
            time.sleep(0.2)
            drained[owner].clear()
            brokers[owner].cancel(0)
            wait_until(drained[owner].is_set, 15, interval=0.02, what=f"{owner}'s drain")
            owner = "B" if owner == "A" else "A"
            handoffs += 1
        feeder.join(60)
        wait_until(lambda: not lost(published, records), 30, what="every message handled")
    finally:
        for broker in brokers.values():
            broker.stop()
        for broker in brokers.values():
            broker.join(10)
    # Then nothing was lost and every key's messages were first handled in order
    assert handoffs >= 6
    assert lost(published, records) == []
    assert order_violations(records) == []
    # and the drains filled their windows (a trickle's never fills by itself), the fillers
    # never reaching the handler: every record is a published message
    filled = sum(broker.fills[0] for broker in brokers.values())
    assert filled >= handoffs // 2, (filled, handoffs)
    assert len(records) == len(published) + sum(r["redelivered"] for r in records)
