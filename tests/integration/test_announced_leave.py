"""A member stopped by SIGTERM announces it first: its partitions move while it consumes them.

Given a coordinator and two consumers under a keyed load, when one gets SIGTERM, then its
member key is marked ``leaving`` (it stays registered), the leader gives its partitions to
the other member, which claims them while the leaving one is still registered; the
leaving one exits 0 once it holds nothing; nothing is lost and per-key order holds. With
``--no-announce-leave`` the member key goes at once (the old way).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from examples import audit

from .groups.harness import Fleet, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 6


@pytest.mark.parametrize("announce", [True, False], ids=["announce", "no-announce"])
def test_a_stopping_member_hands_its_partitions_over_before_it_leaves(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str, announce: bool
) -> None:
    fleet = quorum_fleet(P)
    group = Group(registry.client, registry.where, fleet.stream)
    spec = StreamSpec(fleet.stream, P, "quorum")
    fleet.coordinator(settle=1.0)
    fleet.consumer("c1")
    extra = () if announce else ("--no-announce-leave",)
    leaving = fleet.consumer("c2", extra=extra)
    wait_until(lambda: balanced(group, P, {"c1", "c2"}), 30, 0.1, "c1 and c2 balanced")
    load = SequenceProducer(spec, rabbitmq, keys=24, rate=300.0)
    load.start()
    try:
        wait_until(lambda: len(load.published()) > 200, 20, 0.1, "the load running")
        # When c2 gets SIGTERM
        leaving.signal(signal.SIGTERM)

        # Then (announce) c1 holds every claim while c2 is still registered, marked leaving
        def handed_over() -> bool:
            state = group.snapshot()
            c2 = state.members.get("c2")
            held = {c.member for c in state.claims.values()}
            return c2 is not None and c2.leaving and held == {"c1"} and len(state.claims) == P

        def left() -> bool:
            return "c2" not in group.snapshot().members

        if announce:
            wait_until(handed_over, 20, 0.02, "c1 holding every claim while c2 is leaving")
        else:
            wait_until(left, 5, 0.02, "c2 gone from the group at once")
        assert leaving.popen.wait(30) == 0, leaving.tail()
        wait_until(left, 10, 0.1, "c2 gone")
    finally:
        load.stop()
    # And nothing is lost, every key in order
    sent = load.published()
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "everything handled")
    assert audit.order_violations(fleet.records()) == []
    logs = leaving.log.read_text()
    assert ("stopping: announced" in logs) is announce, leaving.tail()
