"""partq on a 3-node RabbitMQ cluster and a 3-member etcd: the fault campaign of issue 10.

Given three private RabbitMQ nodes clustered on loopback (``tests.cluster``; the machine's
RabbitMQ, or 4.0.5 from the trixie tree with ``PARTQ_TEST_RABBITMQ=4.0.5``), a stream whose
quorum queues have a replica on every node, 2 coordinators and 3 consumers, and the SDK
(and, on demand with ``PARTQ_TEST_EVERY_FAULT=1``, ``partq spark-job`` too: local[2,4],
``tests.spark.sequences``) publishing keyed sequences through the list of the three URLs:
when the node leading most partition queues
is killed -9, or every node is restarted in turn, publishing and consuming go on through
the other nodes. For each fault, and for an etcd member's death and a lost etcd quorum:
nothing confirmed is lost, no two members handle a partition at once, per-key order holds
apart from redeliveries of messages unacked at the fault and replays of Spark batches a
task of which was tried again (counted). Recovery times are printed (``-s``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.cluster import EtcdCluster, RabbitCluster
from tests.conftest import EVERY_FAULT
from tests.rabbit import Install
from tests.spark.sequences import SparkSequences, handled_twice, order_apart_from_replays

from .groups.harness import (
    PREFETCH,
    Fleet,
    SequenceProducer,
    balanced,
    balanced_yet,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.slow]

P = 6


@pytest.fixture(scope="module")
def whole_cluster(
    tmp_path_factory: pytest.TempPathFactory, rabbit_install: Install
) -> Iterator[RabbitCluster]:
    """3 nodes of the machine's RabbitMQ (of 4.0.5 with PARTQ_TEST_RABBITMQ=4.0.5)."""
    with RabbitCluster(tmp_path_factory.mktemp("cluster"), install=rabbit_install) as cluster:
        yield cluster


@pytest.fixture
def cluster(whole_cluster: RabbitCluster) -> RabbitCluster:
    """The module's cluster with all 3 nodes running: a test before may have killed one
    (the node kill leaves its victim down), and the next must not start on 2."""
    whole_cluster.heal()
    return whole_cluster


MEMBERS = {"c1", "c2", "c3"}


def start_group(fleet: Fleet, registry: Registry, partitions: int) -> Group:
    """2 coordinators and 3 consumers (``MEMBERS``) on the fleet's stream, balanced."""
    fleet.coordinator("k1")
    fleet.coordinator("k2")
    for member in sorted(MEMBERS):
        fleet.consumer(member)
    group = Group(registry.client, registry.where, fleet.stream)
    wait_until(lambda: balanced(group, partitions, MEMBERS), 60, 0.2, "balanced")
    return group


def queue_members(cluster: RabbitCluster) -> dict[str, int]:
    """How many nodes hold each queue (its quorum members; 1 for a classic queue)."""
    out = cluster.ctl(
        cluster.nodes[0], "list_queues", "-q", "--no-table-headers", "name", "members"
    )
    return {line.split("\t")[0]: line.count("@localhost") for line in out.splitlines()}


def test_replicas_place_each_partition_queue_on_that_many_nodes(
    cluster: RabbitCluster, registry: Registry, stream_name: str
) -> None:
    # Given a stream created with --replicas 2 on a 3-node cluster
    urls = ",".join(cluster.urls)
    spec = StreamSpec(stream_name, P, "quorum", replicas=2)
    assert admin.create_stream(registry, urls, spec)
    try:
        # Then each partition queue and the dead-letter queue live on 2 nodes
        members = queue_members(cluster)
        assert [members.get(spec.queue(p)) for p in range(P)] == [2] * P
        assert members[spec.dead_letter_queue] == 2
        # And the spec keeps it, so every later declare is the same (RabbitMQ checks it)
        assert registry.read_spec(stream_name).replicas == 2
        assert not admin.create_stream(registry, urls, spec)
        with Producer(stream_name, amqp_url=urls, etcd=registry) as producer:
            futures = [producer.publish(f"k{i}", b"x") for i in range(40)]
            producer.flush(30)
        assert all(f.exception() is None for f in futures)
    finally:
        admin.delete(registry, urls, stream_name)


def assert_nothing_lost(
    fleet: Fleet,
    load: SequenceProducer,
    job: SparkSequences | None,
    crashes: Sequence[audit.Crash] = (),
) -> str:
    """The invariants over the SDK's and the Spark job's sequences; a line saying what ran.

    Nothing confirmed is lost (SDK: confirmed futures; Spark: rows of committed batches);
    no two processes handled a partition at once; per-key order holds apart from what
    ``crashes`` (a node stopped or killed: the connections on it cut) excuse, at most a
    prefetch window of redeliveries per crash and partition, and the messages of Spark
    batches a task of which was tried again (counted); the SDK's only failures are
    publishes nacked or unconfirmed at the fault.
    """
    sent = load.published() | (job.confirmed() if job else set())
    wait_until(lambda: not audit.lost(sent, fleet.records()), 120, 0.25, "all handled")
    records = fleet.records()
    assert audit.overlaps(records) == []
    retried = job.retried_batches() if job else set()
    outside, replayed_out_of_order = order_apart_from_replays(records, retried, crashes)
    assert outside == []
    assert all("nack" in f or "not confirmed" in f for f in load.failed), load.failed[:3]
    redelivered = sum(1 for r in records if r["redelivered"])
    spark = (
        f"Spark: {len(job.confirmed())} rows in {job.committed()} batches, "
        f"{len(retried)} batches with a task tried again, {replayed_out_of_order} replays "
        f"out of order, {handled_twice(records, 'spark-')} rows handled twice; "
        if job
        else ""
    )
    return (
        f"SDK: {len(load.published())} confirmed, {len(load.failed)} nacked and reported; "
        f"{spark}{redelivered} redelivered; 0 lost, 0 overlaps"
    )


# The Spark job as a second publisher costs a JVM and a minute on a busy 2-core machine:
# every fault here runs with the SDK alone in CI and with Spark too on demand (Spark's own
# faults, a worker's and the driver's death, run in CI: tests/spark).
WITH_SPARK = pytest.param(
    True,
    id="sdk+spark",
    marks=[
        pytest.mark.spark,
        pytest.mark.skipif(not os.environ.get(EVERY_FAULT), reason=f"on demand: {EVERY_FAULT}=1"),
    ],
)


@contextlib.contextmanager
def spark_publisher(
    with_spark: bool,
    spec: StreamSpec,
    settings: Settings,
    urls: str,
    directory: Path,
    rows_per_key: int = 10,
) -> Iterator[SparkSequences | None]:
    """``partq spark-job`` publishing keyed sequences through ``urls`` (or nothing)."""
    if not with_spark:
        yield None
        return
    with SparkSequences(
        spec, settings.etcd_endpoints, urls, directory, rows_per_key=rows_per_key
    ) as job:
        yield job


@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_spark", [pytest.param(False, id="sdk"), WITH_SPARK])
def test_a_rolling_restart_of_every_node_loses_nothing(
    cluster: RabbitCluster, registry: Registry, settings: Settings, stream_name: str,
    tmp_path: Path, with_spark: bool,
) -> None:  # fmt: skip
    # Given 2 coordinators and 3 consumers on a stream replicated on all 3 nodes, the SDK
    # (and in the sdk+spark case the Spark job) publishing keyed sequences to the 3 URLs
    urls = ",".join(cluster.urls)
    spec = StreamSpec(stream_name, P, "quorum", replicas=3)
    admin.create_stream(registry, urls, spec)
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, urls, tmp_path / "r.jsonl")
    try:
        with spark_publisher(with_spark, spec, settings, urls, tmp_path / "spark") as job:
            group = start_group(fleet, registry, P)
            if job:
                job.wait_publishing()
            load = SequenceProducer(spec, urls, keys=24, rate=300.0)
            load.start()
            took, spark_took = [], []
            stops: list[audit.Crash] = []  # each stop cuts the connections on that node
            try:
                wait_until(lambda: len(load.published()) > 300, 30, 0.1, "confirms")
                # When each node in turn is stopped and started again, as an upgrade does
                for node in cluster.nodes:
                    began = time.monotonic()
                    cluster.upgrade_ctl(node, "await_online_quorum_plus_one", "-t", "120")
                    stopped_at = time.time()
                    stops.append(audit.Crash(stopped_at, PREFETCH))
                    cluster.stop_node(node)
                    floor = len(load.published()) + 150
                    wait_until(lambda n=floor: len(load.published()) > n, 60, 0.05, "confirms")
                    if job:  # and the Spark job commits 2 batches through the other nodes
                        batches = job.committed() + 1
                        wait_until(lambda b=batches: job.committed() > b, 120, 0.1, "batches")
                        spark_took.append(job.after(stopped_at))
                    cluster.start_node(node)
                    took.append(time.monotonic() - began)
                # Then publishing went on throughout, and the group is whole again
                before = len(load.published())
                wait_until(lambda: len(load.published()) > before + 300, 60, 0.05, "confirms after")
                wait_until(lambda: balanced(group, P, MEMBERS), 60, 0.2, "balanced after")
            finally:
                load.stop()
            if job:
                job.finish()
        summary = assert_nothing_lost(fleet, load, job, stops)
        downs = ", ".join(f"{n} batches, longest pause {p:.1f}s" for _, p, n in spark_took)
        print(
            f"\nrolling restart of {len(took)} nodes ({', '.join(f'{t:.1f}s' for t in took)}); "
            f"{f'Spark while each node was down: {downs}; ' if job else ''}{summary}"
        )
    finally:
        fleet.close()
        with contextlib.suppress(Exception):
            admin.delete(registry, urls, stream_name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_spark", [pytest.param(False, id="sdk"), WITH_SPARK])
def test_killing_the_node_that_leads_most_queues_loses_nothing(
    cluster: RabbitCluster, registry: Registry, settings: Settings, stream_name: str,
    tmp_path: Path, with_spark: bool,
) -> None:  # fmt: skip
    urls = ",".join(cluster.urls)
    spec = StreamSpec(stream_name, P, "quorum")
    admin.create_stream(registry, urls, spec)
    members = queue_members(cluster)
    assert [members.get(spec.queue(p)) for p in range(P)] == [3] * P  # default: on each node
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, urls, tmp_path / "r.jsonl")
    try:
        # (sdk+spark) batches of 6000 rows, so that the kill can fall while one is published
        with spark_publisher(
            with_spark, spec, settings, urls, tmp_path / "spark", rows_per_key=500
        ) as job:
            start_group(fleet, registry, P)
            if job:
                job.wait_publishing()
            load = SequenceProducer(spec, urls, keys=24, rate=300.0)
            load.start()
            try:
                wait_until(lambda: len(load.published()) > 300, 30, 0.1, "confirms")
                # When the node leading most partition queues is killed (while the Spark
                # job's tasks publish a batch)
                counts = collections.Counter(cluster.leaders(spec).values())
                victim = cluster.node(counts.most_common(1)[0][0])
                in_flight = job.wait_in_flight(fleet.record) if job else None
                before, batches = len(load.published()), (job.committed() + 1 if job else 0)
                killed_at, killed_wall = time.monotonic(), time.time()
                cluster.kill(victim)
                # Then publishing goes on through the other nodes, from the SDK (and Spark)
                wait_until(lambda: len(load.published()) > before + 300, 60, 0.05, "confirms")
                resumed = time.monotonic() - killed_at
                if job:
                    wait_until(lambda: job.committed() > batches, 120, 0.1, "Spark batches after")
            finally:
                load.stop()
            if job:
                job.finish()
        summary = assert_nothing_lost(fleet, load, job, [audit.Crash(killed_wall, PREFETCH)])
        # publishes in flight at the leader change may be nacked (not enqueued): the SDK
        # reports them failed, to be sent again; a Spark task with one fails and is retried
        spark = ""
        if job:
            first_commit, pause, _ = job.after(killed_wall)
            spark = (
                f"killed while Spark published batch {in_flight}: its first commit "
                f"{first_commit:.1f}s after the kill, longest pause between commits "
                f"{pause:.1f}s; "
            )
        print(
            f"\nkilled {victim.nodename} (leader of {counts[victim.nodename]} of {P} queues); "
            f"SDK confirms resumed within {resumed:.1f}s; {spark}{summary}"
        )
    finally:
        fleet.close()
        with contextlib.suppress(Exception):
            admin.delete(registry, urls, stream_name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_spark", [pytest.param(False, id="sdk"), WITH_SPARK])
@pytest.mark.parametrize("victim", ["first endpoint", "leader"])
def test_the_group_goes_on_when_an_etcd_member_dies(
    tmp_path: Path, rabbitmq: str, stream_name: str, victim: str, with_spark: bool
) -> None:
    # Given a 3-member etcd, coordinators and consumers given all three endpoints (and in
    # the sdk+spark case the Spark job publishing too)
    with EtcdCluster(tmp_path / "etcd") as etcd:
        settings = Settings.load(etcd_endpoints=etcd.endpoints, amqp_url=rabbitmq)
        registry = Registry.connect(settings)
        spec = StreamSpec(stream_name, 4, "quorum")
        admin.create_stream(registry, rabbitmq, spec)
        fleet = Fleet(stream_name, tmp_path, etcd.endpoints, rabbitmq, tmp_path / "r.jsonl")

        def settled(members: set[str]) -> bool:
            """Balanced, as a fresh client of the live members sees it (False while etcd
            elects a leader)."""
            live = ",".join(m.endpoint for m in etcd.members if m.process is not None)
            observer = Registry.connect(Settings.load(etcd_endpoints=live, etcd_timeout=2.0))
            try:
                return balanced_yet(Group(observer.client, observer.where, stream_name), 4, members)
            finally:
                observer.close()

        spark = contextlib.ExitStack()
        try:
            fleet.coordinator("k1")
            fleet.coordinator("k2")
            fleet.consumer("c1")
            fleet.consumer("c2")
            wait_until(lambda: settled({"c1", "c2"}), 30, 0.2, "c1 and c2 sharing")
            job = spark.enter_context(
                spark_publisher(with_spark, spec, settings, rabbitmq, tmp_path / "spark")
            )
            if job:
                job.wait_publishing()
            load = SequenceProducer(spec, rabbitmq, keys=8, rate=100.0)
            load.start()
            # When the member the clients use first (or the leader) is killed
            member = etcd.members[0] if victim == "first endpoint" else etcd.leader()
            killed_at = time.monotonic()
            etcd.kill(member)
            # Then a consumer that joins now is given its share: leases, watches and
            # elections went on through the other members
            fleet.consumer("c3")
            wait_until(lambda: settled({"c1", "c2", "c3"}), 60, 0.2, "rebalanced")
            recovered = time.monotonic() - killed_at
            if job:  # and the Spark job went on committing batches
                batches = job.committed() + 1
                wait_until(lambda: job.committed() > batches, 120, 0.1, "batches after")
                job.finish()
            load.stop()
            try:
                summary = assert_nothing_lost(fleet, load, job)
            except AssertionError as failure:
                raise AssertionError(f"{failure}\n{fleet.logs()}") from failure
            print(
                f"\netcd {victim} killed: a consumer joining at once had its share "
                f"{recovered:.1f}s after the kill; {summary}"
            )
        finally:
            spark.close()
            fleet.close()
            with contextlib.suppress(Exception):
                admin.delete(registry, rabbitmq, stream_name)
            registry.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("with_spark", [pytest.param(False, id="sdk"), WITH_SPARK])
def test_the_group_waits_out_a_lost_etcd_quorum_and_loses_nothing(
    tmp_path: Path, rabbitmq: str, stream_name: str, with_spark: bool
) -> None:
    # Given a 3-member etcd, 2 coordinators and 3 consumers under load (the SDK, and in
    # the sdk+spark case the Spark job, which reads etcd only when it starts)
    with EtcdCluster(tmp_path / "etcd") as etcd:
        settings = Settings.load(etcd_endpoints=etcd.endpoints, amqp_url=rabbitmq)
        registry = Registry.connect(settings)
        spec = StreamSpec(stream_name, 6, "quorum")
        admin.create_stream(registry, rabbitmq, spec)
        fleet = Fleet(stream_name, tmp_path, etcd.endpoints, rabbitmq, tmp_path / "r.jsonl")
        frozen: list[LocalEtcd] = []
        spark = contextlib.ExitStack()
        try:
            group = start_group(fleet, registry, 6)
            job = spark.enter_context(
                spark_publisher(with_spark, spec, settings, rabbitmq, tmp_path / "spark")
            )
            if job:
                job.wait_publishing()
            load = SequenceProducer(spec, rabbitmq, keys=12, rate=200.0)
            load.start()
            try:
                wait_until(lambda: len(load.published()) > 200, 30, 0.1, "confirms")
                # When 2 of the 3 members stop for 15 s (SIGSTOP: quorum lost), then go on
                leader = etcd.leader()
                frozen = [leader, next(m for m in etcd.members if m is not leader)]
                for member in frozen:
                    assert member.process is not None
                    member.process.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
                wait_until(lambda: time.monotonic() - stopped_at >= 15, 20, 0.5, "15 s")
                handled_during = len(fleet.records())
                for member in frozen:
                    assert member.process is not None
                    member.process.send_signal(signal.SIGCONT)
                frozen = []
                resumed_at = time.monotonic()

                # Then the group is whole again: same members, balanced, claims held (our
                # reads time out while the resumed members elect a leader: not yet)
                wait_until(lambda: balanced_yet(group, 6, MEMBERS), 60, 0.2, "balanced after")
                recovered = time.monotonic() - resumed_at
                if job:  # and the Spark job went on committing batches
                    batches = job.committed() + 1
                    wait_until(lambda: job.committed() > batches, 120, 0.1, "batches after")
            finally:
                load.stop()
                if job:
                    job.finish()
            summary = assert_nothing_lost(fleet, load, job)
            print(
                f"\netcd quorum lost 15 s: {handled_during} handled by its end, group whole "
                f"{recovered:.1f}s after; {summary}"
            )
        finally:
            for member in frozen:
                if member.process is not None:
                    member.process.send_signal(signal.SIGCONT)
            spark.close()
            fleet.close()
            with contextlib.suppress(Exception):
                admin.delete(registry, rabbitmq, stream_name)
            registry.close()
