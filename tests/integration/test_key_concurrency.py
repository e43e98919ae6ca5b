"""Key-level concurrency under faults, on real etcd and RabbitMQ, consumers as OS processes.

Given consumers with ``--concurrency 64`` and an ``async def`` handler that holds each
message 100 ms, under a keyed load (P = 12, 200 keys), when a member joins, one leaves
with SIGTERM and one is killed with SIGKILL (its partitions moving after its lease, or at
once to their hot standby), then:

- nothing confirmed is lost, and no partition is in two processes at once;
- no two handlings of one key ever overlap, in any processes;
- per key, handlings are in order, apart from redeliveries of what the killed member had
  in flight, and those (late first handlings and repeats together) stay within the
  prefetch window per partition it owned (``audit.order_violations(..., repeats=True)``);
- keys of one partition did run at once.

And partq's status shows a member's concurrency, its messages in handlers and the key
waiting longest behind its own.

A message acked before its coroutine finished would be lost when the kill cut its
handler short: "nothing lost" covers that for async handlers under load.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from partq.coordinator.ops.status import snapshot_status
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry

from examples import audit

from .groups.harness import PREFETCH, Fleet, Proc, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 12
OPTIONS = {"handler": "record_async", "extra": ("--concurrency", "64")}


def _settle(group: Group, fleet: Fleet, members: set[str], timeout: float = 30.0) -> None:
    _settle_on(group, fleet, P, members, timeout)


def _settle_on(
    group: Group, fleet: Fleet, partitions: int, members: set[str], timeout: float = 30.0
) -> None:
    try:
        wait_until(
            lambda: balanced(group, partitions, members), timeout, 0.1, f"balance on {members}"
        )
    except AssertionError:
        print(fleet.logs())
        raise


def _kill_mid_round(victim: Proc, load: SequenceProducer) -> audit.Crash:
    """SIGKILL ``victim`` just after a round of the load was published: each of its
    partitions then has messages in a 100 ms handler."""
    began = load.started
    wait_until(lambda: load.started > began, 5, 0.005, "a new round")
    time.sleep(0.05)
    crash = audit.Crash(time.time(), PREFETCH, victim.pid)
    victim.kill()
    return crash


def _held_by(group: Group, member: str) -> bool:
    claims = group.snapshot().claims.values()
    return len(claims) == P and {c.member for c in claims} == {member}


@pytest.mark.fault
@pytest.mark.parametrize("standby", [False, True], ids=["lease-expiry", "hot-standby"])
def test_keys_stay_in_order_through_join_leave_and_kill_with_concurrency_64(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str, standby: bool
) -> None:
    fleet = quorum_fleet(P)
    spec = StreamSpec(fleet.stream, P, "quorum")
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.1"
    # A standby takes over long before a 10 s lease runs out; without one, 2 s
    ttl = 10 if standby else 2
    fleet.coordinator(extra=("--standby",) if standby else ("--no-standby",))
    members = {m: fleet.consumer(m, ttl=ttl, **OPTIONS) for m in ("c1", "c2")}  # type: ignore[arg-type]
    _settle(group, fleet, {"c1", "c2"})
    if standby:
        wait_until(lambda: len(group.snapshot().standbys) == P, 20, 0.1, "a standby each")
    load = SequenceProducer(spec, rabbitmq, keys=200, rate=800.0)
    load.start()
    try:
        wait_until(lambda: len(fleet.records()) > 1000, 40, 0.1, "the load flowing")
        # When c3 joins, then leaves with SIGTERM (planned handoffs both ways)
        members["c3"] = fleet.consumer("c3", ttl=ttl, **OPTIONS)  # type: ignore[arg-type]
        _settle(group, fleet, {"c1", "c2", "c3"})
        time.sleep(1.5)
        assert members.pop("c3").terminate() == 0, fleet.logs()
        _settle(group, fleet, {"c1", "c2"})
        time.sleep(1.5)
        # and c2 is killed with messages in its handlers
        killed = _kill_mid_round(members.pop("c2"), load)
        if standby:  # c1 takes c2's partitions over through the broker, not the lease
            wait_until(lambda: _held_by(group, "c1"), 20, 0.05, "c1 holding every claim")
            assert "taken over" in members["c1"].tail(2000), fleet.logs()
        _settle(group, fleet, {"c1"})
        time.sleep(1.5)
    finally:
        load.stop()
    sent = load.published()
    assert not load.failed, load.failed[:5]
    wait_until(lambda: not audit.lost(sent, fleet.records()), 60, 0.25, "everything handled")
    records = fleet.records()
    # Then nothing is lost, no partition or key is in two handlers at once, and per key
    # the only disorder and repeats are what the killed member had in flight
    assert audit.lost(sent, records) == []
    assert audit.overlaps(records) == []
    assert audit.key_overlaps(records) == []
    # every handling carries its owner's fencing token, greater at each change of owner
    assert all(r["fencing_token"] > 0 for r in records)
    assert audit.fencing_regressions(records) == []
    assert audit.order_violations(records, [killed], repeats=True) == []
    after = [r for r in records if r["start"] > killed.at]
    redelivered = sum(1 for r in after if r.get("redelivered"))
    repeats = len(records) - len({(r["key"], r["seq"]) for r in records})
    together = audit.concurrent_keys(records)
    print(
        f"\n{'standby' if standby else 'lease'}: {len(sent)} sent, {len(records)} handled, "
        f"{redelivered} redelivered after the kill ({repeats} repeats, "
        f"{audit.redelivered_out_of_order(records)} late), {together} beside another key"
    )
    assert redelivered > 0, "the kill found nothing in flight: the crash path went untested"
    assert together > 0


def test_the_status_shows_a_members_concurrency_in_flight_and_waiting_key(
    quorum_fleet: Callable[[int], Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a consumer with --concurrency 8 whose async handler holds each message 300 ms
    fleet = quorum_fleet(4)
    spec = StreamSpec(fleet.stream, 4, "quorum")
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.3"
    fleet.coordinator()
    extra = ("--concurrency", "8", "--load-report", "1")
    fleet.consumer("c1", handler="record_async", extra=extra)
    _settle_on(group, fleet, 4, {"c1"})
    # When 30 messages of one key and 12 of others are published
    with Producer(spec, amqp_url=rabbitmq) as producer:
        for seq in range(30):
            producer.publish("hot", json.dumps({"seq": seq}), message_id=f"hot:{seq}")
        for i in range(12):
            producer.publish(f"cold-{i}", json.dumps({"seq": 0}), message_id=f"cold-{i}:0")
        producer.flush(30)

    # Then partq's status shows the setting, messages in handlers per member and per
    # partition, and "hot" as the key waiting longest behind its own
    def shown() -> dict[str, Any] | None:
        status = snapshot_status(registry, rabbitmq, fleet.stream)
        [member] = status["members"] or [None]
        busy = member is not None and (member["in_flight"] or 0) > 0
        waiting = member is not None and member["waiting_key"] == "'hot'"
        return status if busy and waiting else None

    status = wait_until(shown, 20, 0.2, "the status showing the hot key waiting")
    [member] = status["members"]
    assert member["concurrency"] == 8 and member["waiting_s"] > 0
    assert sum(r["in_flight"] or 0 for r in status["rows"]) > 0
    hot = spec.partition_for("hot")
    assert status["rows"][hot]["in_flight"] >= 1
