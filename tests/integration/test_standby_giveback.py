"""A hot standby that the broker activated and that must give what it was sent back (a
takeover refused: the partition had moved on) returns it ahead of anything newer, under
load, on the broker.

The owner's connection dies holding deliveries (``Broker.fence`` aborts its socket, as a
kill -9 would); RabbitMQ activates the standby, which is sent the owner's deliveries first
and then newer ones while it decides; it gives everything back at once. A delivery still
on its way when a consumer's ``basic.cancel`` is applied is returned by the broker's
channel at once, ahead of anything its client returns after cancel-ok; so the give-back
does not cancel: it aborts the standby's own connection, and RabbitMQ returns everything
that consumer held, in order, before it serves any other consumer. (Done by cancel, then
one nack each at cancel-ok, about one round in eight reordered here on RabbitMQ 3.10.8:
the newest delivery came back first; on 4.0.5 the same race gave an heir's give-back 21
order violations in a 3-minute fault soak.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from partq.consumers.broker.connection import Broker
from partq.consumers.broker.port import Activated, BrokerEvent, Delivery, StandbyLost
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer

from examples.audit import lost, order_violations
from tests.conftest import EVERY_FAULT, Ctl
from tests.polling import wait_until
from tests.rabbit import PrivateRabbit

from .groups.harness import consumers_by_queue, one_quorum_partition, record_of

pytestmark = [pytest.mark.integration]

KEYS = [f"k{i}" for i in range(8)]
ROUNDS = 12
HELD = 20  # deliveries each owner holds unacked when its connection dies


@pytest.fixture(params=["machine", "4.0.5"])
def broker(request: pytest.FixtureRequest) -> tuple[str, Ctl]:
    """The machine's RabbitMQ (3.10 here), or a private 4.0.5 node: its URL and rabbitmqctl.
    On 4.0.5 on demand (``PARTQ_TEST_EVERY_FAULT=1``): under CI's load it took 108-155 s
    (17 s alone), and CI's 3-minute fault soak on 4.0.5 gives back activated standbys too."""
    if request.param == "4.0.5":
        if not os.environ.get(EVERY_FAULT):
            pytest.skip(f"on 4.0.5 on demand: {EVERY_FAULT}=1 (CI's time budget)")
        node: PrivateRabbit = request.getfixturevalue("rabbit_40_node")
        return node.url, node.ctl
    return request.getfixturevalue("rabbitmq"), request.getfixturevalue("rabbitmqctl")


@pytest.fixture
def spec(broker: tuple[str, Ctl], stream_name: str) -> Iterator[StreamSpec]:
    with one_quorum_partition(broker[0], stream_name) as spec:
        yield spec


class Member:
    """One Broker: an owner that acks each delivery only once ``HELD`` newer ones came (so
    it always holds some), or a standby that records its activation and its give-back."""

    def __init__(self, name: str, rabbitmq: str, spec: StreamSpec, records: list[Any]) -> None:
        self.name = name
        self.records = records
        self.held: list[Delivery] = []
        self.holding = HELD  # 0: ack each delivery at once (the last owner, at the end)
        self.activated = threading.Event()
        self.returned = threading.Event()
        self.broker = Broker(
            rabbitmq, spec, prefetch=100, heartbeat=10, name=f"giveback-{name}", sink=self.sink
        )
        self.broker.start()
        assert self.broker.connected.wait(15)

    def sink(self, event: BrokerEvent) -> None:
        match event:
            case Delivery():
                self.held.append(event)
                while len(self.held) > self.holding:
                    done = self.held.pop(0)
                    self.records.append(
                        record_of(done, self.name) | {"partition": 0, "pid": self.name}
                    )
                    self.broker.ack(done.partition, done.channel, done.delivery_tag)
            case Activated():
                self.activated.set()
            case StandbyLost():
                self.returned.set()

    def holds_its_window(self) -> bool:
        return len(self.held) == HELD

    def stop(self) -> None:
        self.broker.stop()
        self.broker.join(10)


def test_an_activated_standby_gives_back_ahead_of_anything_newer(
    spec: StreamSpec, broker: tuple[str, Ctl]
) -> None:
    rabbitmq, rabbitmqctl = broker
    records: list[dict[str, Any]] = []
    published: list[tuple[str, int]] = []
    feeding = threading.Event()
    feeding.set()

    def feed() -> None:
        with Producer(spec, amqp_url=rabbitmq) as producer:
            n = 0
            while feeding.is_set() and n < 200_000:
                key = KEYS[n % len(KEYS)]
                producer.publish(key, f"{key}:{n // len(KEYS)}")
                published.append((key, n // len(KEYS)))
                n += 1
                time.sleep(0.002)
            producer.flush(30)

    queue = spec.queue(0)
    members: list[Member] = []
    feeder = threading.Thread(target=feed, daemon=True)
    try:
        owner = Member("owner-0", rabbitmq, spec, records)
        members.append(owner)
        assert owner.broker.subscribe(0, 1)
        feeder.start()
        for n in range(ROUNDS):
            # Given an owner consuming under a keyed load, holding deliveries unacked, and
            # a standby subscribed behind it
            standby = Member(f"standby-{n}", rabbitmq, spec, records)
            members.append(standby)
            assert standby.broker.stand_by(0)
            wait_until(lambda: consumers_by_queue(rabbitmqctl)[queue] == 2, 20, 0.05, "standing")
            wait_until(owner.holds_its_window, 10, 0.01, "the owner holding")
            # When the owner's connection dies, the broker activates the standby, and the
            # standby gives back everything at once
            owner.broker.fence()
            wait_until(standby.activated.is_set, 10, 0.001, "the standby activated")
            standby.broker.give_back(0)
            wait_until(standby.returned.is_set, 10, 0.005, "the give-back done")
            # (then the next owner subscribes and is served what the standby held first)
            owner = Member(f"owner-{n + 1}", rabbitmq, spec, records)
            members.append(owner)
            assert owner.broker.subscribe(0, 1)
            wait_until(owner.holds_its_window, 10, 0.01, "the next owner holding")
        owner.holding = 0  # acks what it holds as the next delivery comes
        wait_until(lambda: not owner.held, 10, 0.01, "the last owner holding nothing")
        feeding.clear()
        feeder.join(60)
        try:
            wait_until(lambda: not lost(published, records), 30, 0.05, "every message handled")
        except AssertionError as e:
            missing = lost(published, records)
            held = [(m.name, len(m.held)) for m in members if m.held]
            raise AssertionError(f"{e}: {len(missing)} not, {missing[:5]}…; held: {held}") from e
    finally:
        feeding.clear()
        for member in members:
            member.stop()
    # Then every message was handled, each key's in order, the standbys' returns included
    assert len(records) >= len(published) > ROUNDS * HELD
    assert order_violations(records) == []
