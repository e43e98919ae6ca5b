"""The invariants of docs/architecture.md on real etcd and RabbitMQ, consumers as OS processes.

Each test starts its own stream (P = 12, quorum queues), coordinator and
consumers (``partq consume`` with ``recorder.record`` as handler), produces keyed
sequences, disturbs the group, and checks the handler records with ``checker``.
Measurements are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pika
import pytest
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry

from examples import audit as checker
from examples.audit import Crash
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

from .harness import PREFETCH, Fleet, SequenceProducer, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 12
SETTLE = 12.0  # bound for a group to converge after a step (TTL 2 s, settle 0.3 s)


@contextmanager
def stream_fleet(
    registry: Registry, etcd: str, amqp: str, name: str, tmp: Path
) -> Iterator[tuple[Fleet, Group, StreamSpec]]:
    spec = StreamSpec(name, P, "quorum")
    admin.create_stream(registry, amqp, spec)
    fleet = Fleet(name, tmp, etcd, amqp, tmp / "records.jsonl")
    try:
        yield fleet, Group(registry.client, registry.where, name), spec
    finally:
        fleet.close()
        try:
            admin.delete(registry, amqp, name)
        except Exception as e:  # etcd may be the thing a failed test left down
            print(f"cleanup of {name} failed: {e}")


@pytest.fixture
def env(
    registry: Registry, settings: Settings, rabbitmq: str, stream_name: str, tmp_path: Path
) -> Iterator[tuple[Fleet, Group, StreamSpec]]:
    with stream_fleet(registry, settings.etcd_endpoints, rabbitmq, stream_name, tmp_path) as e:
        yield e


def settle(
    group: Group, fleet: Fleet, members: set[str], timeout: float = SETTLE
) -> dict[int, str]:
    try:
        state = wait_until(
            lambda: balanced(group, P, members), timeout, what=f"balance over {sorted(members)}"
        )
    except AssertionError:
        print(fleet.logs())
        raise
    return dict(state.assignment)


def handled_all(fleet: Fleet, producer: SequenceProducer, timeout: float = 30.0) -> list[dict]:
    published = producer.published()
    assert not producer.failed, producer.failed[:5]
    wait_until(
        lambda: not checker.lost(published, fleet.records()),
        timeout,
        interval=0.25,
        what="every published message handled",
    )
    return fleet.records()


def assert_invariants(
    records: list[dict],
    published: set,
    frozen: dict | None = None,
    crashes: Sequence[checker.Crash] = (),
) -> None:
    """Nothing lost, one at a time, and per-key order of first handlings.

    ``crashes``: consumers killed (kill -9) under load. What one held unacked is
    redelivered and may be handled after newer messages of its key: at most a prefetch
    window per crash and partition, redeliveries of messages published before the kill,
    on partitions it owned (``checker.order_violations``). Those are counted and printed;
    any other violation fails. A frozen owner (``frozen``) or etcd away is no excuse: a
    fenced owner gives back what it held first, in order.
    """
    assert checker.lost(published, records) == []
    assert checker.overlaps(records, frozen) == []
    assert checker.order_violations(records, crashes) == []
    assert all(r["fencing_token"] > 0 for r in records)
    assert checker.fencing_regressions(records) == []
    if crashes:
        print(
            f"redelivered after newer messages of their key: "
            f"{checker.redelivered_out_of_order(records)}"
        )


def summary(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (
        f"{name}: n={len(ms)} p50={checker.percentile(ms, 50):.1f} ms "
        f"p99={checker.percentile(ms, 99):.1f} ms max={max(ms, default=float('nan')):.1f} ms"
    )


@pytest.mark.usefixtures("machine_version_in_ci")  # 4.0.5: test_priority_handoff's moves
def test_scale_up_and_down_keeps_every_invariant(env, rabbitmq: str) -> None:
    fleet, group, spec = env
    fleet.coordinator()
    consumers = {"c1": fleet.consumer("c1")}
    assignment = settle(group, fleet, {"c1"})
    producer = SequenceProducer(spec, rabbitmq)
    producer.start()
    steps: list[str] = []
    try:
        for action, member in [("add", "c2"), ("add", "c3"), ("remove", "c3"), ("remove", "c2")]:
            time.sleep(1.5)
            began = time.monotonic()
            if action == "add":
                consumers[member] = fleet.consumer(member)
            else:  # SIGTERM: drain, release, revoke; exits once its partitions are handed over
                assert consumers.pop(member).terminate() == 0, fleet.logs()
            live = set(consumers)
            before = assignment
            assignment = settle(group, fleet, live)
            moved = checker.moves(before, assignment)
            least = checker.min_moves(P, before, live)
            steps.append(
                f"{action} {member}: {moved} moved (min {least}) in {time.monotonic() - began:.2f}s"
            )
            assert moved == least, steps
        time.sleep(1.0)
    finally:
        producer.stop()
    records = handled_all(fleet, producer)
    published = producer.published()
    print("\n" + "\n".join(steps))
    print(f"published {len(published)}, handled {len(records)} records")
    print(
        summary(
            "handoff gap (last handling by old owner -> first by new)",
            checker.handoff_gaps(records),
        )
    )
    assert_invariants(records, published)


@pytest.mark.parametrize("handler", ["record", "record_async"])
@pytest.mark.usefixtures("machine_version_in_ci")  # 4.0.5: test_priority_handoff's moves
def test_concurrency_keeps_keys_in_order_through_a_join_and_a_leave(
    env, rabbitmq: str, handler: str
) -> None:
    # Given consumers with --concurrency 16 and a 20 ms handler (sync or async def)
    fleet, group, spec = env
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.02"
    options = {"handler": handler, "extra": ("--concurrency", "16")}
    fleet.coordinator()
    consumers = {"c1": fleet.consumer("c1", **options)}
    settle(group, fleet, {"c1"})
    producer = SequenceProducer(spec, rabbitmq, keys=60, rate=600.0)
    producer.start()
    try:
        # When a member joins, then leaves with SIGTERM (planned handoffs both ways)
        time.sleep(1.5)
        consumers["c2"] = fleet.consumer("c2", **options)
        settle(group, fleet, {"c1", "c2"})
        time.sleep(1.5)
        assert consumers.pop("c2").terminate() == 0, fleet.logs()
        settle(group, fleet, {"c1"})
        time.sleep(1.0)
    finally:
        producer.stop()
    records = handled_all(fleet, producer)
    # Then nothing is lost, no partition is in two processes, each key in order, never
    # two of a key at once; and keys of one partition did run at once
    assert_invariants(records, producer.published())
    assert checker.key_overlaps(records) == []
    together = checker.concurrent_keys(records)
    print(f"{handler}: {len(records)} records, {together} started beside another key")
    assert together > 0


@pytest.mark.fault
def test_kill_9_consumer_partitions_move_after_ttl(env, rabbitmq: str) -> None:
    fleet, group, spec = env
    fleet.coordinator()
    c1, c2 = fleet.consumer("c1"), fleet.consumer("c2")
    before = settle(group, fleet, {"c1", "c2"})
    producer = SequenceProducer(spec, rabbitmq)
    producer.start()
    try:
        time.sleep(1.5)
        killed_at = time.time()
        c2_pid = c2.pid
        c2.kill()
        settle(group, fleet, {"c1"})
        failover = time.time() - killed_at
        time.sleep(1.0)
    finally:
        producer.stop()
    records = handled_all(fleet, producer)
    moved = sorted(p for p, owner in before.items() if owner == "c2")
    firsts = [
        min(starts) - killed_at
        for p in moved
        if (
            starts := [
                r["start"]
                for r in records
                if r["partition"] == p and r["pid"] == c1.pid and r["start"] > killed_at
            ]
        )
    ]
    print(
        f"\nfailover after kill -9 (TTL 2 s): balanced again after {failover:.2f}s; "
        f"first handling by c1: {summary('per moved partition', firsts)}"
    )
    print(f"redelivered records: {sum(1 for r in records if r['redelivered'])}")
    assert failover >= 1.0, "partitions moved before the lease could expire"
    assert_invariants(records, producer.published(), crashes=[Crash(killed_at, PREFETCH, c2_pid)])


def freeze_c2(env, rabbitmq: str, heartbeat: int) -> tuple[list[dict], int, tuple[float, float]]:
    """Two consumers whose handler works 100 ms in 5 ms steps, busy about 80% of the time
    (so c2 is frozen inside handler calls, with steps left to do), and AMQP heartbeat
    ``heartbeat``; c2 SIGSTOPped 6 s under load (lease TTL 2 s), then resumed and the group
    balanced again. The records, c2's pid and its frozen window."""
    fleet, group, spec = env
    fleet.env["PARTQ_RECORD_SLEEP"] = "0.1"
    # a window of 10: a planned handoff back to c2 waits for c1's window, 1 s of work
    extra = ("--heartbeat", str(heartbeat), "--prefetch", "10")
    options = {"handler": "record_stepwise", "extra": extra}
    fleet.coordinator()
    fleet.consumer("c1", **options)
    c2 = fleet.consumer("c2", **options)
    settle(group, fleet, {"c1", "c2"})
    producer = SequenceProducer(spec, rabbitmq, keys=24, rate=96.0)
    producer.start()
    try:
        time.sleep(1.5)
        stopped_at = c2.freeze()
        time.sleep(6.0)
        resumed_at = time.time()
        c2.signal(signal.SIGCONT)
        settle(group, fleet, {"c1", "c2"}, timeout=20)
        converged = time.time() - resumed_at
        time.sleep(1.0)
    finally:
        producer.stop()
    records = handled_all(fleet, producer)
    print(f"\nSIGSTOP 6 s (TTL 2 s, heartbeat {heartbeat} s): converged {converged:.2f}s after")
    assert checker.lost(producer.published(), records) == []
    assert checker.order_violations(records) == []
    return records, c2.pid, (stopped_at, resumed_at)


@pytest.mark.fault
def test_sigstop_longer_than_ttl_no_overlap(env, rabbitmq: str) -> None:
    """An owner frozen inside handler calls past its lease, before RabbitMQ notices (AMQP
    heartbeat 30 s): resumed, it finishes those calls before its fence hands the partitions
    on, so the next owner never handles beside it."""
    records, pid, window = freeze_c2(env, rabbitmq, heartbeat=30)
    frozen = {pid: [window]}
    inside = checker.frozen_inside(records, frozen)
    print(f"handler calls c2 was frozen inside: {len(inside)}")
    assert inside, "c2 was not frozen inside a handler call: the test proves nothing"
    assert checker.overlaps(records, frozen) == []


@pytest.mark.fault
@pytest.mark.usefixtures("machine_version_in_ci")  # the broker's heartbeat: version-blind
def test_sigstop_past_the_heartbeat_only_the_calls_under_way_overlap(env, rabbitmq: str) -> None:
    """The limit: when RabbitMQ notices the frozen owner first (heartbeat 1 s), the next
    owner starts during the freeze, and a handler call the owner was frozen inside finishes
    beside it on resuming (a thread cannot be stopped). Nothing else overlaps: the resumed
    owner begins no call before it fences."""
    records, pid, window = freeze_c2(env, rabbitmq, heartbeat=1)
    frozen = {pid: [window]}
    beside = checker.finished_beside(records, frozen)
    overlaps = checker.overlaps(records, frozen)
    print(f"calls c2 was frozen inside that finished beside c1: {len(beside)}; {overlaps}")
    assert len(beside) <= P // 2, "at most one call under way per partition it owned"
    assert checker.overlaps_unexplained(records, frozen) == []
    # and a store that keeps the greatest fencing token would refuse each such late call:
    # the next owner's calls, begun during the freeze, carry greater tokens
    for call in beside:
        newer = [
            r["fencing_token"]
            for r in records
            if r["partition"] == call["partition"] and r["pid"] != pid and window[0] < r["start"]
        ]
        assert newer and min(newer) > call["fencing_token"], call
    assert checker.fencing_regressions(records) == []


@pytest.mark.fault
@pytest.mark.usefixtures("machine_version_in_ci")  # coordinator and etcd faults: broker-blind
def test_kill_leading_coordinator_another_takes_over(env, rabbitmq: str) -> None:
    fleet, group, spec = env
    a = fleet.coordinator("coordinator-a")
    leader_a = wait_until(lambda: group.snapshot().leaders, 10, what="a leader")[0][1]
    fleet.coordinator("coordinator-b")
    wait_until(lambda: len(group.snapshot().leaders) == 2, 10, what="two candidates")
    fleet.consumer("c1"), fleet.consumer("c2")
    settle(group, fleet, {"c1", "c2"})
    producer = SequenceProducer(spec, rabbitmq)
    producer.start()
    try:
        time.sleep(1.0)
        killed_at = time.monotonic()
        a.kill()
        counts = [len(fleet.records())]
        while time.monotonic() - killed_at < 10:
            time.sleep(0.5)
            counts.append(len(fleet.records()))
            leaders = [key for _, key in group.snapshot().leaders]
            if leaders and leader_a not in leaders:
                break
        takeover = time.monotonic() - killed_at
        assert leaders and leader_a not in leaders, f"no new leader: {leaders}"
        fleet.consumer("c3")
        settle(group, fleet, {"c1", "c2", "c3"})
        time.sleep(1.0)
    finally:
        producer.stop()
    records = handled_all(fleet, producer)
    print(
        f"\nleader takeover after kill -9 (TTL 2 s): {takeover:.2f}s; "
        f"handled counts while leaderless: {counts}"
    )
    assert all(b > a for a, b in itertools.pairwise(counts)), counts
    assert_invariants(records, producer.published())


@pytest.mark.fault
@pytest.mark.usefixtures("machine_version_in_ci")  # coordinator and etcd faults: broker-blind
def test_etcd_down_consumers_keep_consuming_then_converge(
    rabbitmq: str, stream_name: str, tmp_path: Path
) -> None:
    etcd = LocalEtcd(data_dir=tmp_path / "etcd")
    etcd.data_dir.mkdir()
    etcd.start()
    registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint, amqp_url=rabbitmq))
    try:
        with stream_fleet(registry, etcd.endpoint, rabbitmq, stream_name, tmp_path) as env:
            fleet, group, spec = env
            fleet.coordinator()
            fleet.consumer("c1"), fleet.consumer("c2")
            settle(group, fleet, {"c1", "c2"})
            producer = SequenceProducer(spec, rabbitmq)
            producer.start()
            try:
                time.sleep(1.0)
                down_at = time.time()
                etcd.stop()
                counts = [len(fleet.records())]
                for _ in range(10):
                    time.sleep(1.0)
                    counts.append(len(fleet.records()))
                up_at = time.time()
                during = [r for r in fleet.records() if down_at + 1 < r["start"] < up_at]
                members_during = sorted({r["member"] for r in during})
                partitions_during = len({r["partition"] for r in during})
                etcd.start()
                settle(group, fleet, {"c1", "c2"}, timeout=30)
                converged = time.time() - up_at
                fleet.consumer("c3")  # the group must still react to changes: watches resumed
                settle(group, fleet, {"c1", "c2", "c3"}, timeout=30)
                rebalanced = time.time() - up_at
                time.sleep(1.0)
            finally:
                producer.stop()
            records = handled_all(fleet, producer)
            print(
                f"\netcd down 10 s: handled counts each second {counts}; "
                f"{len(during)} handled by {members_during} on {partitions_during} partitions "
                f"while down; converged {converged:.2f}s after etcd came back, "
                f"rebalanced onto c3 {rebalanced:.2f}s after"
            )
            assert all(b > a for a, b in itertools.pairwise(counts)), counts
            busy = {spec.partition_for(key) for key in producer.keys}
            assert members_during == ["c1", "c2"] and partitions_during == len(busy)
            assert_invariants(records, producer.published())
    finally:
        registry.close()
        etcd.stop()


def test_poison_message_is_dead_lettered_and_its_partition_flows(env, rabbitmq: str) -> None:
    fleet, group, spec = env
    fleet.coordinator()
    fleet.consumer("c1", handler="poison", extra=("--max-attempts", "3"))
    settle(group, fleet, {"c1"})
    key, poisoned = "key-poisoned", 3
    published = set()
    with Producer(spec, amqp_url=rabbitmq) as producer:
        for seq in range(10):
            body = json.dumps({"seq": seq, **({"poison": 1} if seq == poisoned else {})})
            producer.publish(key, body, message_id=f"{key}:{seq}").result(10)
            if seq != poisoned:
                published.add((key, seq))
    wait_until(lambda: not checker.lost(published, fleet.records()), 20, what="the other messages")
    records = fleet.records()
    assert all(r["seq"] != poisoned for r in records)
    poisoned_started = [r["start"] for r in records if r["seq"] > poisoned]
    assert poisoned_started, "later messages of the partition were not handled"
    assert checker.order_violations(records) == []

    def dead_letter() -> tuple | None:
        with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as conn:
            channel = conn.channel()
            method, props, body = channel.basic_get(spec.dead_letter_queue, auto_ack=True)
            return (props, body) if method else None

    props, body = wait_until(dead_letter, 10, interval=0.25, what="the dead letter")
    assert b"poison" in body
    headers = props.headers
    assert "poison message" in headers["x-partq-error"]
    assert headers["x-partq-attempts"] == 3
    assert props.message_id == f"{key}:{poisoned}"
