"""Hot standby (``coordinator --standby``): kill -9 of an owner, and its standby takes over
through the broker, before the dead owner's lease expires.

Given a leader naming a standby per partition and two consumers with a 10 s lease, each
partition queue has two consumers (owner, waiting standby). When one consumer is killed
with SIGKILL under a keyed load, the other holds every claim (takeover claims) while the
dead member is still registered, the leader reassigns to it, nothing is lost, no two
handle a partition at once, and per-key order holds apart from redeliveries of what the
dead owner had not acked.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from examples import audit
from tests.conftest import Ctl

from .groups.harness import PREFETCH, Fleet, Proc, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault]

P = 4


def assert_flowed_in_order(
    fleet: Fleet, load: SequenceProducer, killed: audit.Crash, members: dict[str, Proc]
) -> None:
    """Every confirmed message handled within 30 s, never two owners at once, every late
    one explained by the kill, and no partition reported stalled."""
    sent = load.published()
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "everything handled")
    records = fleet.records()
    assert audit.overlaps(records) == []
    assert audit.order_violations(records, [killed]) == []
    assert not any("stalled" in m.tail(2000) for m in members.values())


def consumers_per_queue(rabbitmqctl: Ctl, spec: StreamSpec) -> list[int]:
    """Consumers per partition queue, waiting ones included (a passive declare counts only
    the active one of a single-active-consumer quorum queue)."""
    out = rabbitmqctl("list_consumers", "-q", "--no-table-headers")
    queues = [line.split("\t", 1)[0] for line in out.splitlines()]
    return [queues.count(spec.queue(p)) for p in range(spec.partitions)]


def wait_for_two_consumers_each(
    rabbitmqctl: Ctl, spec: StreamSpec, members: dict[str, Proc], timeout: float = 30
) -> None:
    """Every partition queue has its owner's consumer and its standby's. Else fail naming
    the queues that do not, with what each member logged about them."""
    wanted = [2] * spec.partitions
    counts: list[int] = []

    def two_each() -> bool:
        counts[:] = consumers_per_queue(rabbitmqctl, spec)
        return counts == wanted

    try:
        wait_until(two_each, timeout, 0.2, "2 consumers each")
    except AssertionError:
        wrong = [p for p, n in enumerate(counts) if n != 2]
        said = {
            name: [
                line
                for line in m.tail(20000).splitlines()
                if any(f"partition {p}:" in line for p in wrong)
            ]
            for name, m in members.items()
        }
        raise AssertionError(
            f"consumers per queue {counts}; not 2 on {wrong}; logged: {said}"
        ) from None


def test_a_standby_takes_over_a_killed_owner_before_its_lease_expires(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str, rabbitmqctl: Ctl
) -> None:
    fleet = quorum_fleet(P)
    spec = StreamSpec(fleet.stream, P, "quorum")
    group = Group(registry.client, registry.where, fleet.stream)
    args = ["coordinator", fleet.stream, "--settle", "0.3", "--ttl", "2", "--standby"]
    fleet._start("coordinator", [*args, "--http-port", "0"], fleet._env())
    members = {"c1": fleet.consumer("c1", ttl=10), "c2": fleet.consumer("c2", ttl=10)}
    wait_until(lambda: balanced(group, P, set(members)), 30, 0.1, "balanced")
    # Given every partition has its owner and a standby subscribed behind it
    wait_until(lambda: len(group.snapshot().standbys) == P, 20, 0.1, "a standby per partition")
    wait_for_two_consumers_each(rabbitmqctl, spec, members)
    load = SequenceProducer(spec, rabbitmq, keys=16, rate=300.0)
    load.start()
    try:
        wait_until(lambda: len(fleet.records()) > 300, 20, 0.1, "the load flowing")
        # When c1 is killed
        killed = audit.Crash(time.time(), PREFETCH, members["c1"].pid)
        members["c1"].signal(signal.SIGKILL)

        # Then c2 holds every claim while c1 is still a member (its lease has 10 s to run)
        def taken_over() -> bool:
            state = group.snapshot()
            held = {c.member for c in state.claims.values()}
            return "c1" in state.members and held == {"c2"} and len(state.claims) == P

        wait_until(taken_over, 8, 0.02, "c2 holding every claim before c1's lease expires")
        claims = group.snapshot().claims
        assert any(c.takeover for c in claims.values())
        # and the leader gives it the partitions
        wait_until(
            lambda: set(group.snapshot().assignment.values()) == {"c2"}, 10, 0.1, "reassigned"
        )
    finally:
        load.stop()
    assert_flowed_in_order(fleet, load, killed, members)
    assert "taken over" in members["c2"].tail(400)


def test_a_takeover_under_load_keeps_the_partition_flowing(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str, rabbitmqctl: Ctl
) -> None:
    """Three members, P = 12, kill -9 of one under load: every confirmed message is handled
    within a bound, not just the prefetch window each takeover got from the dead owner
    (seen: a channel warming for a partition the leader gave the standby took the place of
    the promoted one, so the worker's acks were dropped and nothing came after 100). Run it
    on 4.0.5 too (PARTQ_TEST_RABBITMQ=4.0.5): the race showed there in 1 run of 3."""
    partitions = 12
    fleet = quorum_fleet(partitions)
    spec = StreamSpec(fleet.stream, partitions, "quorum")
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(extra=("--standby",))
    fleet.env["PARTQ_STALL_AFTER"] = (
        "5"  # a stall is told (partq.consumers.state.flow) within the run
    )
    names = ("c1", "c2", "c3")
    members = {m: fleet.consumer(m, ttl=10) for m in names}
    wait_until(lambda: balanced(group, partitions, set(names)), 40, 0.1, "balanced")
    wait_until(lambda: len(group.snapshot().standbys) == partitions, 20, 0.1, "a standby each")
    wait_for_two_consumers_each(rabbitmqctl, spec, members)
    load = SequenceProducer(spec, rabbitmq, keys=100, rate=1000.0)
    load.start()
    try:
        wait_until(lambda: len(fleet.records()) > 2000, 30, 0.1, "the load flowing")
        victim = group.snapshot().assignment[1]
        killed = audit.Crash(time.time(), PREFETCH, members[victim].pid)
        members[victim].signal(signal.SIGKILL)
        wait_until(
            lambda: victim not in group.snapshot().assignment.values(), 15, 0.1, "reassigned"
        )
        time.sleep(3)
    finally:
        load.stop()
    assert_flowed_in_order(fleet, load, killed, members)
