"""A fenced owner never reorders: an owner frozen past its lease gives back, first and in
order, what it held unacked.

Given two consumers (lease TTL 5 s, so AMQP heartbeat 5 s: the broker would notice a
frozen one only after about 10 s) under a keyed load, when one is frozen (SIGSTOP) until
the other has claimed and subscribed to every partition it owned (waiting behind it at
the broker), then resumed (SIGCONT): it finds its lease lost and fences (aborting its
connection), the other is served the frozen owner's unacked messages first, and per-key
order holds with no excuse: nothing lost, no two handle a partition at once, no message
of a key handled after a newer one. Before the fence aborted the connection, it closed
channels gracefully, and the next owner was served a window of newer messages first
(docs/benchmarks.md, "Fencing").
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.settings import Settings

from .groups.harness import Fleet, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.fault]

P = 4
TTL = 5  # the consumers' lease, and so their AMQP heartbeat


@pytest.fixture(params=["quorum", "classic"])
def fleet(
    request: pytest.FixtureRequest,
    registry: Registry,
    settings: Settings,
    rabbitmq: str,
    stream_name: str,
    tmp_path: Path,
) -> Iterator[Fleet]:
    spec = StreamSpec(stream_name, P, request.param)
    admin.create_stream(registry, rabbitmq, spec)
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, rabbitmq, tmp_path / "rec.jsonl")
    try:
        yield fleet
    finally:
        fleet.close()
        admin.delete(registry, rabbitmq, stream_name)


def consuming_since(log: Path, offset: int) -> set[int]:
    """Partitions the consumer logged it subscribed to after byte ``offset`` of its log."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return {int(p) for p in re.findall(r"partition (\d+): consuming", text)}


def test_an_owner_frozen_past_its_lease_gives_back_in_order(
    fleet: Fleet, registry: Registry, rabbitmq: str
) -> None:
    spec = registry.read_spec(fleet.stream)
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator()
    c1, c2 = fleet.consumer("c1", ttl=TTL), fleet.consumer("c2", ttl=TTL)
    state = wait_until(lambda: balanced(group, P, {"c1", "c2"}), 30, 0.1, "balanced")
    frozen_owned = sorted(p for p, owner in state.assignment.items() if owner == "c2")
    load = SequenceProducer(spec, rabbitmq, keys=40, rate=400.0)
    load.start()
    try:
        wait_until(lambda: len(fleet.records()) > 400, 20, 0.1, "the load flowing")
        # When c2 is frozen until c1 has subscribed to each of its partitions, behind it
        offset = c1.log.stat().st_size
        stopped_at = c2.freeze()
        wait_until(
            lambda: consuming_since(c1.log, offset) >= set(frozen_owned),
            2 * TTL - 1,  # resumed before the broker could notice the freeze itself
            0.1,
            f"c1 subscribed to {frozen_owned} behind the frozen c2",
        )
        resumed_at = time.time()
        c2.signal(signal.SIGCONT)
        # Then c2 fences itself (aborts its connection), rejoins, and the group rebalances
        wait_until(lambda: "lease lost" in c2.tail(400), 10, 0.1, "c2 finding its lease lost")
        wait_until(lambda: balanced(group, P, {"c1", "c2"}), 30, 0.1, "balanced again")
        time.sleep(1.0)  # some load after the rebalance
    finally:
        load.stop()
    sent = load.published()
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "everything handled")
    records = fleet.records()
    redelivered = sum(1 for r in records if r["redelivered"])
    print(
        f"\n{spec.queue_type}: c2 frozen {resumed_at - stopped_at:.1f}s (TTL {TTL}s), "
        f"{len(sent)} published, {len(records)} handled, {redelivered} redelivered"
    )
    assert "lost the RabbitMQ connection" not in c2.tail(400)  # ours, not the broker's
    assert audit.lost(sent, records) == []
    assert audit.overlaps(records, {c2.pid: [(stopped_at, resumed_at)]}) == []
    violations = audit.order_violations(records)
    assert violations == [], f"{len(violations)} order violations: {violations[:5]}"
    assert redelivered > 0  # c2 held messages when frozen: they were redelivered
