"""A planned handoff by consumer priority on RabbitMQ 4.0.5 quorum (consumers/state/priority.py):
the heir, subscribed above the owner, is served only once the owner has settled every
delivery, and then exactly what follows, in order, with nothing returned. Then the daemon
(``--handoff auto``, consumers as OS processes): planned moves under load, and a kill -9 of
either side mid-switch, with nothing lost, no overlap, every key in order."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from partq.consumers.broker.connection import Broker
from partq.consumers.broker.port import BrokerEvent, ChannelLost, Delivery, Drained, End, Subscribed
from partq.consumers.state.priority import YIELD_WAIT
from partq.coordinator.store.group import Group
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer
from partq.producer.registry import Registry

from examples import audit as checker
from examples.audit import Crash
from partq.kernel.settings import Settings
from tests.conftest import Ctl
from tests.integration.groups.harness import (
    PREFETCH,
    Fleet,
    Proc,
    SequenceProducer,
    consumers_by_queue,
    one_quorum_partition,
)
from tests.integration.groups.test_invariants import (
    SETTLE,
    P,
    assert_invariants,
    handled_all,
    settle,
    stream_fleet,
    summary,
)
from tests.polling import wait_until
from tests.rabbit import PrivateRabbit

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def spec(rabbitmq_40: str, stream_name: str) -> Iterator[StreamSpec]:
    with one_quorum_partition(rabbitmq_40, stream_name) as spec:
        yield spec


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


# -- the daemon: planned moves by priority, and crashes mid-switch ------------------------


@pytest.fixture
def fleet_40(
    registry: Registry, settings: Settings, rabbitmq_40: str, stream_name: str, tmp_path: Path
) -> Iterator[tuple[Fleet, Group, StreamSpec]]:
    """A P = 12 quorum stream on the 4.0.5 node whose consumers hand over by priority."""
    with stream_fleet(registry, settings.etcd_endpoints, rabbitmq_40, stream_name, tmp_path) as e:
        e[0].env["PARTQ_HANDOFF"] = "auto"
        yield e


@contextmanager
def _under_load(spec: StreamSpec, url: str, **options: float) -> Iterator[SequenceProducer]:
    """A SequenceProducer publishing while the body runs, and a second more."""
    producer = SequenceProducer(spec, url, **options)  # type: ignore[arg-type]
    producer.start()
    try:
        yield producer
        time.sleep(1.0)
    finally:
        producer.stop()


def _count(fleet: Fleet, text: str, member: str | None = None) -> int:
    return sum(
        proc.log.read_text(errors="replace").count(text)
        for proc in fleet.procs
        if member is None or proc.name == member
    )


def test_the_daemon_moves_partitions_by_priority_under_load_in_order(
    fleet_40, rabbitmq_40: str
) -> None:
    # Given c1 consuming all 12 partitions under load (400 msg/s, a 2 ms handler)
    fleet, group, spec = fleet_40
    fleet.coordinator()
    consumers = {"c1": fleet.consumer("c1")}
    settle(group, fleet, {"c1"})
    with _under_load(spec, rabbitmq_40) as producer:
        # When members join and leave (SIGTERM), each a rebalance of planned moves
        for action, member in [("add", "c2"), ("add", "c3"), ("remove", "c3"), ("remove", "c2")]:
            time.sleep(1.5)
            if action == "add":
                consumers[member] = fleet.consumer(member)
            else:
                assert consumers.pop(member).terminate() == 0, fleet.logs()
            settle(group, fleet, set(consumers))
    records = handled_all(fleet, producer)
    # Then every move went by the broker's switch, and nothing is lost, overlapped or
    # out of order
    switched = _count(fleet, "RabbitMQ switched to us")
    drained = _count(fleet, "and its heir has not taken it over: draining")
    print(
        f"\n{len(records)} records; {switched} moves by priority, {drained} drained after "
        f"{YIELD_WAIT}s (idle partitions: no delivery proves the switch); "
        + summary("handoff gap", checker.handoff_gaps(records))
    )
    assert switched >= 12, fleet.logs()  # 4 + 4 (joins) and 4 + 6 (leaves) moves at least
    assert _count(fleet, "planned handoffs: by consumer priority") == 3
    assert_invariants(records, producer.published())


def _wait_for_heirs(fleet: Fleet, owner: str, heir: str, *, every: bool = False) -> None:
    """Until ``owner`` yields a partition and ``heir`` subscribed above it (``every``: above
    each partition it yields)."""

    def subscribed() -> bool:
        yielding = _count(fleet, "consuming until it takes over", owner)
        heirs = _count(fleet, "(priority ", heir)
        return bool(yielding and heirs) and (not every or heirs >= yielding)

    wait_until(
        subscribed,
        SETTLE,
        interval=0.02,
        what=f"{owner} yielding to {heir}, subscribed above it as heir",
    )


def _handoff_lines(fleet: Fleet, member: str) -> str:
    """``member``'s log lines of stand-bys, heirs, takeovers and give-backs: a failure's
    story, short enough to survive CI's cut of a long output."""
    words = ("priority", "taken over", "giving back", "standing by", "refused", "yield")
    return "\n".join(
        line
        for proc in fleet.procs
        if proc.name == member
        for line in proc.log.read_text(errors="replace").splitlines()
        if any(word in line for word in words)
    )


@contextmanager
def _mid_switch(
    fleet_40: tuple[Fleet, Group, StreamSpec], url: str, ctl: Ctl, ttl: int
) -> Iterator[tuple[Proc, Proc, SequenceProducer]]:
    """c1 consuming every partition with a slow handler (50 ms: below the 50 msg/s each
    partition gets, so c1 always holds a full window, which takes 5 s to settle) at
    600 msg/s; c2 joins (10 ms) and the body runs once c1 yields its partitions and
    RabbitMQ lists c2's heir consumers above them: (c1, c2, the producer), stopped after
    the body."""
    fleet, group, spec = fleet_40
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.05"
    fleet.coordinator()
    c1 = fleet.consumer("c1", handler="record_async", ttl=ttl)
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.01"
    settle(group, fleet, {"c1"})
    with _under_load(spec, url, rate=600.0) as producer:
        time.sleep(2.0)
        c2 = fleet.consumer("c2", ttl=ttl)
        _wait_for_heirs(fleet, "c1", "c2", every=True)
        _wait_for_consumers(fleet, ctl, spec, "c1")
        yield c1, c2, producer


def _wait_for_consumers(fleet: Fleet, ctl: Ctl, spec: StreamSpec, owner: str) -> None:
    """Until RabbitMQ lists two consumers (the owner's, the heir's) on each partition
    ``owner`` yields: an heir's log line comes before its subscription reaches the broker
    (its own connection opens first)."""
    pattern = re.compile(r"partition (\d+): moved to \w+: consuming until it takes over")
    log = "".join(p.log.read_text(errors="replace") for p in fleet.procs if p.name == owner)
    yielded = sorted({int(n) for n in pattern.findall(log)})
    assert yielded, f"{owner} yields nothing"

    def both() -> bool:
        counts = consumers_by_queue(ctl)
        return all(counts[spec.queue(p)] >= 2 for p in yielded)

    wait_until(both, SETTLE, interval=0.1, what=f"two consumers on {yielded}")


def test_an_owner_killed_mid_switch_hands_over_in_order_before_its_lease_ends(
    fleet_40, rabbitmq_40: str, rabbit_40_node: PrivateRabbit
) -> None:
    fleet, group, _ = fleet_40
    with _mid_switch(fleet_40, rabbitmq_40, rabbit_40_node.ctl, ttl=5) as (c1, _, producer):
        # When c1 is killed -9 while c2 waits above it: the broker had not switched yet
        killed_at, c1_pid = time.time(), c1.pid
        yielding = _count(fleet, "consuming until it takes over", "c1")
        switched = _count(fleet, "RabbitMQ switched to us", "c2")
        c1.kill()
        settle(group, fleet, {"c2"}, timeout=20)
    records = handled_all(fleet, producer)
    # Then c2's heirs took over as soon as c1's connection died (its lease 5 s), and what
    # c1 held came back first: nothing lost, no overlap, in order
    after = [
        r["start"] - killed_at for r in records if r["pid"] != c1_pid and r["start"] > killed_at
    ]
    print(
        f"\nkilled with {yielding} partitions yielding, {switched} switched; first handling "
        f"by c2 after the kill: {min(after, default=float('nan')):.3f}s"
    )
    assert yielding > switched, "the kill came after every switch: nothing was mid-switch"
    assert _count(fleet, "RabbitMQ switched to us", "c2") > switched, _handoff_lines(fleet, "c2")
    # no crash excuse: a dead connection's deliveries come back first, in order
    assert_invariants(records, producer.published())
    assert any(r["redelivered"] for r in records if r["start"] > killed_at)


def test_an_heir_killed_while_waiting_leaves_the_owner_consuming_in_order(
    fleet_40, rabbitmq_40: str, rabbit_40_node: PrivateRabbit
) -> None:
    with _mid_switch(fleet_40, rabbitmq_40, rabbit_40_node.ctl, ttl=2) as (_, c2, producer):
        # When c2 is killed -9 while it waits above c1 / Then c1 keeps every partition
        crash = Crash(time.time(), PREFETCH, c2.pid)
        c2.kill()
        settle(fleet_40[1], fleet_40[0], {"c1"}, timeout=20)
    # (c1's 50 ms handler is behind the load: its backlog takes a while)
    records = handled_all(fleet_40[0], producer, timeout=90)
    assert_invariants(records, producer.published(), crashes=[crash])


def test_hot_standbys_and_heirs_at_once_move_by_priority_then_take_over_a_killed_owner(
    fleet_40, rabbitmq_40: str
) -> None:
    """The heir outranks the standby (x-priority 0): a move switches to the heir and never
    activates the standby, which then stands behind the new owner (it stood behind the old
    one) and takes over when that one is killed. No ``--standby``: on quorum queues the leader
    names standbys by default."""
    fleet, group, spec = fleet_40
    fleet.coordinator()
    members = {m: fleet.consumer(m, ttl=10) for m in ("c1", "c2")}
    settle(group, fleet, set(members))
    wait_until(lambda: len(group.snapshot().standbys) == P, SETTLE, what="a standby each")
    with _under_load(spec, rabbitmq_40, keys=96, rate=600.0) as producer:
        time.sleep(1.5)
        # When c3 joins: planned moves while every partition has a standby
        members["c3"] = fleet.consumer("c3", ttl=10)
        settle(group, fleet, set(members), timeout=20)
        wait_until(lambda: len(group.snapshot().standbys) == P, SETTLE, what="a standby each")
        time.sleep(1.5)
        switched = _count(fleet, "RabbitMQ switched to us")
        # and then c3, the new owner, is killed -9
        crash = Crash(time.time(), PREFETCH, members["c3"].pid)
        members.pop("c3").kill()
        wait_until(
            lambda: _count(fleet, "is gone from RabbitMQ: taken over"), 10, what="a takeover"
        )
        settle(group, fleet, set(members), timeout=30)
    records = handled_all(fleet, producer)
    # Then the moves went by priority, no standby was activated by them, a standby took
    # over from the killed owner before its lease (10 s) ended, and every key is in order
    takeovers = _count(fleet, "is gone from RabbitMQ: taken over")
    given_back = _count(fleet, "giving our activated standby subscription back")
    print(f"\n{switched} moves by priority, {takeovers} takeovers, {given_back} given back")
    assert switched >= 4 and takeovers >= 1, fleet.logs()
    assert_invariants(records, producer.published(), crashes=[crash])
