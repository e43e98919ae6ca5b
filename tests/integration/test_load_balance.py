"""Lag-aware assignment on real etcd and RabbitMQ (``coordinator --balance load``).

Given a load-balancing coordinator and two consumers balanced by count, when every message
goes to the partitions of one member, then both members' load reports are in etcd, the
leader moves hot partitions to the idle member (at most ``--load-moves`` a tick), and
nothing is lost, every key in order.
"""

from __future__ import annotations

from collections.abc import Callable

import mmh3
import pytest
from partq.coordinator.leader.loads import member_loads
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from examples import audit

from .groups.harness import Fleet, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 6


def keys_of(partitions: set[int], count: int) -> list[str]:
    """``count`` keys that hash into ``partitions`` (the contract's hash)."""
    found = []
    for i in range(100_000):
        key = f"hot-{i}"
        if mmh3.hash(key, 0, signed=False) % P in partitions:
            found.append(key)
            if len(found) == count:
                return found
    raise AssertionError("no keys found")


def test_hot_partitions_move_to_the_idle_member(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a coordinator balancing by load (1 s ticks, 1 move a tick) and c1, c2 by count
    fleet = quorum_fleet(P)
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(extra=("--balance", "load", "--load-interval", "1", "--load-moves", "1"))
    for member in ("c1", "c2"):
        fleet.consumer(member, extra=("--load-report", "1"))
    state = wait_until(lambda: balanced(group, P, {"c1", "c2"}), 30, 0.1, "c1, c2 balanced")
    hot = {p for p, owner in state.assignment.items() if owner == "c1"}
    assert len(hot) == 3

    # When every message goes to c1's three partitions
    load = SequenceProducer(StreamSpec(fleet.stream, P, "quorum"), rabbitmq, rate=300.0)
    load.keys = keys_of(hot, 30)
    load.start()
    try:
        # Then both members report what they handle (c2: nothing), c1 about 300 msg/s
        def reported() -> bool:
            reports = group.loads()
            return set(reports) == {"c1", "c2"} and reports["c1"].total > 100

        wait_until(reported, 20, 0.2, "load reports of c1 and c2")

        # And the leader moves hot partitions to c2 until the load is as even as it gets
        def spread() -> bool:
            now = group.snapshot()
            claims = {p: c.member for p, c in now.claims.items()}
            mine = {p for p, owner in now.assignment.items() if owner == "c2"}
            return len(mine & hot) >= 1 and claims == now.assignment

        wait_until(spread, 30, 0.2, "a hot partition given to c2 and claimed")
    finally:
        load.stop()
    after = group.snapshot().assignment
    shares = dict.fromkeys(range(P), 0.0)
    for key in load.keys:
        shares[mmh3.hash(key, 0, signed=False) % P] += 1
    levels = member_loads(after, shares, {"c1": 1, "c2": 1})
    assert max(levels.values()) < len(load.keys), (after, levels)  # c1 no longer has them all

    # And nothing is lost, every key in order
    sent = load.published()
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "everything handled")
    assert audit.order_violations(fleet.records()) == []
