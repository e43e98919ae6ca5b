"""``partq pause`` / ``partq resume`` under load, on real etcd and RabbitMQ.

Given a coordinator and two consumers under a keyed load, when one partition is paused,
then its owner drains it and stops consuming (its queue has no consumer and grows, no
record of it is added) while it keeps the claim and the other partitions flow on; when its
owner stops, the new owner takes it over still paused; when it is resumed, everything is
handled: nothing lost, every key in order.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import pika
import pytest
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.queue_probes import queue_stats
from partq.producer.registry import Registry

from examples import audit

from .groups.harness import PARTQ, ROOT, Fleet, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 4
PAUSED = 1


def partq(fleet: Fleet, *args: str) -> str:
    done = subprocess.run(
        [str(PARTQ), *args], env=fleet._env(), cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def depth(rabbitmq: str, spec: StreamSpec, partition: int) -> tuple[int, int]:
    """(messages, consumers) of one partition queue."""
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        stats = queue_stats(connection, spec)[partition]
    assert stats.messages is not None and stats.consumers is not None
    return stats.messages, stats.consumers


def handled(fleet: Fleet, partition: int) -> int:
    return sum(1 for r in fleet.records() if r["partition"] == partition)


def test_a_paused_partition_is_kept_unconsumed_across_a_handoff_then_resumed(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str
) -> None:
    fleet = quorum_fleet(P)
    spec = StreamSpec(fleet.stream, P, "quorum")
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(settle=0.5)
    members = {"c1": fleet.consumer("c1"), "c2": fleet.consumer("c2")}
    wait_until(lambda: balanced(group, P, set(members)), 30, 0.1, "balanced")
    load = SequenceProducer(spec, rabbitmq, keys=16, rate=200.0)
    load.start()
    try:
        wait_until(lambda: handled(fleet, PAUSED) > 20, 20, 0.1, "the paused partition flowing")
        # When partition 1 is paused
        assert "paused" in partq(fleet, "pause", fleet.stream, "--partition", str(PAUSED))
        # Then its owner drains it and stops consuming it, and keeps its claim
        owner = group.snapshot().assignment[PAUSED]
        wait_until(lambda: depth(rabbitmq, spec, PAUSED)[1] == 0, 20, 0.1, "no consumer")
        frozen = handled(fleet, PAUSED)
        others = {p: handled(fleet, p) for p in range(P) if p != PAUSED}
        wait_until(lambda: depth(rabbitmq, spec, PAUSED)[0] >= 30, 30, 0.1, "messages waiting")
        assert handled(fleet, PAUSED) == frozen
        assert all(handled(fleet, p) > n for p, n in others.items()), "the others flow on"
        report: dict[str, Any] = json.loads(partq(fleet, "status", fleet.stream, "--json"))
        assert report["paused"] == [PAUSED]
        assert report["rows"][PAUSED]["state"] == "paused"
        assert report["claims"][str(PAUSED)] == owner

        # When its owner stops, the other member takes it over, still paused
        members[owner].signal(signal.SIGTERM)
        assert members[owner].popen.wait(30) == 0, members[owner].tail()
        (rest,) = set(members) - {owner}
        wait_until(
            lambda: (
                group.snapshot().claims.get(PAUSED) is not None
                and group.snapshot().claims[PAUSED].member == rest
            ),
            20,
            0.1,
            "the new owner holding the paused partition",
        )
        assert depth(rabbitmq, spec, PAUSED)[1] == 0
        assert handled(fleet, PAUSED) == frozen

        # When it is resumed, it flows again
        assert "resumed" in partq(fleet, "resume", fleet.stream)
        wait_until(lambda: depth(rabbitmq, spec, PAUSED)[1] == 1, 20, 0.1, "consumed again")
    finally:
        load.stop()
    # And nothing is lost, every key in order
    sent = load.published()
    wait_until(
        lambda: sent <= {(r["key"], r["seq"]) for r in fleet.records()}, 30, 0.25, "all handled"
    )
    assert audit.order_violations(fleet.records()) == []
