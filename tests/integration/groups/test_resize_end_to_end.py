"""A real resize end to end (docs/resize.md): ``partq stream resize --wait`` under load.

Both halves of issue 22 together, nothing done by hand: a running coordinator assigns the
layouts, three consumer daemons (one with ``--concurrency 8``) record the fences they reach
and gate the keys that moved, an SDK producer that follows the spec publishes keyed
sequences throughout, and the command carries out the protocol, 6 -> 12 and then 12 -> 8,
each while the old partitions hold a backlog. Then: nothing confirmed is lost, per key
every handling is in publish order and never overlaps another of its key, no fence reached
a handler, the retired queues are gone (deleted only once empty: nothing was lost), and the
spec is epoch 2 with 8 partitions.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pika
import pytest

from coordinator import resize
from coordinator.group import Group
from kernel import keys
from producer import Producer
from producer.registry import Registry
from producer.topology import scan_partition_queues

from .harness import PARTQ, Fleet, wait_until
from .test_resize_clients import Backlog, KeyedLoad, audited, drained, flowing, settle

pytestmark = [pytest.mark.integration]

MEMBERS = {"c1", "c2", "c3"}


def resized(fleet: Fleet, partitions: int, backlog: Backlog) -> tuple[int, str]:
    """Run ``partq stream resize --wait`` while the old partitions hold a backlog; its exit
    code and output."""
    argv = [str(PARTQ), "stream", "resize", fleet.stream, "--partitions", str(partitions)]
    with backlog:
        command = fleet.process(f"resize-{partitions}", [*argv, "--wait", "--timeout", "120"])
    try:
        code = command.popen.wait(150)
    except subprocess.TimeoutExpired:
        code = -1
    return code, command.tail(20)


@pytest.mark.slow
def test_partq_stream_resize_grows_then_shrinks_under_load_keeping_every_keys_order(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a stream of 6 partitions, a coordinator, three consumers (one with
    # concurrency), and an SDK producer that follows the spec, publishing 60 keys at 600/s
    fleet = quorum_fleet(6)
    stream = fleet.stream
    group = Group(registry.client, registry.where, stream)
    backlog = Backlog(fleet)
    fleet.coordinator()
    fleet.consumer("c1", handler="slow_while")
    fleet.consumer("c2", handler="slow_while", extra=("--concurrency", "8"))
    fleet.consumer("c3", handler="slow_while")
    settle(group, fleet, 6, MEMBERS)
    producer = Producer(stream, amqp_url=rabbitmq, etcd=registry, name="e2e-load")
    load = KeyedLoad(producer)
    load.start()
    try:
        wait_until(lambda: len(fleet.records()) > 1500, 60, 0.1, "the load flowing")
        # When `partq stream resize --partitions 12 --wait` runs under the load
        code, out = resized(fleet, 12, backlog)
        assert code == 0, out + fleet.logs()
        # Then it returned with every old partition's fence recorded, and 12 are consumed
        assert drained(registry, stream, 0) == set(range(6))
        settle(group, fleet, 12, MEMBERS)
        flowing(fleet, "flowing at 12")
        # And when it shrinks 12 -> 8 the same way (the retired 8..11 stay assigned until
        # their fence, then their queues are deleted)
        code, out = resized(fleet, 8, backlog)
        assert code == 0, out + fleet.logs()
        settle(group, fleet, 8, MEMBERS)
        flowing(fleet, "flowing at 8")
    finally:
        load.stop()
        producer.close()  # after flushing what is unconfirmed
    # Then nothing confirmed is lost, no fence reached a handler, per key every handling
    # is in publish order and none overlaps another of its key
    sent, records = audited(load, fleet)
    # And the spec is epoch 2 with 8 partitions, the resize retired, its retired queues
    # deleted (only once empty: nothing is lost) and no other queue left beyond 8
    spec = registry.read_spec(stream)
    assert (spec.epoch, spec.partitions) == (2, 8)
    raw, _meta = registry.client.get(keys.resize(stream))
    state = resize.decode(raw)
    assert state.phase is resize.Phase.RETIRED and state.deleted == frozenset(range(8, 12))
    assert drained(registry, stream, 1) == set(range(12))
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert scan_partition_queues(connection, stream, 8) == []
        assert len(scan_partition_queues(connection, stream)) == 8
    moved = {r["key"] for r in records if r["partition"] >= 6}
    print(
        f"\n{len(sent)} sent, {len(records)} handled, {len(moved)} keys handled in a "
        f"partition >= 6, {producer.rerouted} returned by the cuts and republished"
    )
