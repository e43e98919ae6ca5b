"""Consumer groups on one stream (docs/groups.md), on real etcd and RabbitMQ processes.

Two groups of one stream, each with its own coordinator and consumers, under one keyed SDK
load (the producer publishes once): each group handles every confirmed message, per key
in publish order and never two at once, through a resize that changes every group's
queues; a redrive in one group reaches that group alone; and the group commands say what
they did and refuse what would lose messages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace

import pika
import pika.exceptions
import pytest
from partq.coordinator.ops import dlq
from partq.coordinator.store.group import Group
from partq.producer import Producer
from partq.producer.contract import group_scope, partition_exchange
from partq.producer.queue_probes import scan_partition_queues
from partq.producer.registry import Registry

from examples import audit
from partq.kernel import keys

from ..test_parking import partq as run_partq
from .harness import Fleet, wait_until
from .test_resize_clients import audited, drained, flowing, keyed_load, settle

pytestmark = [pytest.mark.integration]


# each call's exit code is the test's to check
partq = functools.partial(run_partq, check=False)


def group_fleet(fleet: Fleet, group: str) -> Fleet:
    """A fleet on ``group`` of ``fleet``'s stream (its scope is the stream it names), with a
    record file of its own; its processes end with ``fleet``'s."""
    other = replace(
        fleet,
        stream=group_scope(fleet.stream, group),
        record=fleet.tmp / f"rec-{group}.jsonl",
        procs=fleet.procs,
    )
    return other


@pytest.mark.slow
def test_two_groups_each_handle_every_message_in_order_through_a_resize(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a stream of 4 partitions and a second group, billing, made by the command
    fleet = quorum_fleet(4)
    stream = fleet.stream
    made = partq(fleet, "group", "create", stream, "billing")
    assert made.returncode == 0, made.stderr
    assert f"group billing of {stream} created" in made.stdout
    billing = group_fleet(fleet, "billing")
    # And each group a coordinator and two consumers
    fleet.coordinator()
    billing.coordinator("coordinator-billing")
    for member in ("c1", "c2"):
        fleet.consumer(member)
        billing.consumer(f"b-{member}")
    settle(Group(registry.client, registry.where, stream), fleet, 4, {"c1", "c2"})
    billing_group = Group(registry.client, registry.where, billing.stream)
    settle(billing_group, billing, 4, {"b-c1", "b-c2"})
    # When one SDK producer publishes keyed sequences, and the stream grows 4 -> 8 under it
    with keyed_load(stream, rabbitmq, registry, "groups-load") as load:
        flowing(fleet, "the default group handling", 600)
        flowing(billing, "billing handling", 600)
        resized = partq(fleet, "stream", "resize", stream, "-p", "8", "--wait", "--timeout", "120")
        assert resized.returncode == 0, resized.stderr + fleet.logs()
        settle(billing_group, billing, 8, {"b-c1", "b-c2"})
        flowing(fleet, "the default group at 8", 600)
        flowing(billing, "billing at 8", 600)
        # And shrinks 8 -> 4 (every group's retired queues deleted once empty)
        resized = partq(fleet, "stream", "resize", stream, "-p", "4", "--wait", "--timeout", "120")
        assert resized.returncode == 0, resized.stderr + fleet.logs()
        settle(billing_group, billing, 4, {"b-c1", "b-c2"})
        flowing(billing, "billing at 4", 600)
    # Then each group handled every confirmed message, per key in order, never overlapping
    try:
        sent, records = audited(load, fleet)
        billing_sent, billing_records = audited(load, billing)
    except AssertionError:
        spec = registry.read_spec(stream)
        for f in (fleet, billing):
            lost = audit.lost(load.published(), f.records())
            parts = sorted({spec.partition_for(k) for k, _ in lost})
            print(f.stream, len(lost), "lost, partitions", parts, sorted(lost)[:5])
        print(fleet.logs())
        raise
    assert sent == billing_sent
    # And each resize waited for both groups' fences, and changed both groups' queues
    assert drained(registry, stream, 1) == set(range(8))  # (the grow's went with the shrink)
    assert drained(registry, billing.stream, 1) == set(range(8))
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert len(scan_partition_queues(connection, stream)) == 4
        assert len(scan_partition_queues(connection, billing.stream)) == 4
        # the retired partitions' exchanges went with their queues; the others route
        channel = connection.channel()
        channel.exchange_declare(partition_exchange(stream, 3), passive=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="NOT_FOUND"):
            channel.exchange_declare(partition_exchange(stream, 4), passive=True)
    # And `group list` shows both groups with their members
    listed = partq(fleet, "group", "list", stream, "--json")
    assert listed.returncode == 0, listed.stderr
    shown = {g["group"]: g["members"] for g in json.loads(listed.stdout)}
    assert shown == {"default": 2, "billing": 2}
    print(
        f"\n{len(sent)} confirmed; default handled {len(records)}, billing {len(billing_records)}"
    )


def test_a_redrive_in_one_group_reaches_that_group_alone(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a stream whose failing messages are dead-lettered, with a second group whose
    # handler fails key-a's messages while a flag file exists
    fleet = quorum_fleet(2, "dead-letter")
    stream = fleet.stream
    assert partq(fleet, "group", "create", stream, "audit").returncode == 0
    auditing = group_fleet(fleet, "audit")
    flag = fleet.tmp / "poisoned"
    flag.touch()
    auditing.env = {
        **fleet.env,
        "PARTQ_POISON_KEY": "key-a",
        "PARTQ_POISON_SEQ": "0",
        "PARTQ_POISON_FLAG": str(flag),
    }
    fleet.coordinator(settle=0.5)
    auditing.coordinator("coordinator-audit", settle=0.5)
    fleet.consumer("c1")
    auditing.consumer("a1", handler="poison_key", extra=("--max-attempts", "1"))
    settle(Group(registry.client, registry.where, stream), fleet, 2, {"c1"})
    settle(Group(registry.client, registry.where, auditing.stream), auditing, 2, {"a1"})
    spec = registry.read_spec(auditing.stream)
    # When key-a's 4 messages are published once
    with Producer(stream, amqp_url=rabbitmq, etcd=registry) as producer:
        for seq in range(4):
            producer.publish("key-a", json.dumps({"seq": seq}).encode(), message_id=f"a:{seq}")
        producer.flush(30)
    # Then the default group handled them, and the audit group dead-lettered them
    wait_until(lambda: len(fleet.records()) == 4, 30, 0.2, "the default group handling")
    wait_until(lambda: dlq.dead_letter_depth(rabbitmq, spec) == 4, 30, 0.2, "dead letters")
    assert auditing.records() == []
    # And when the audit group's dead letters are redriven (its handler fixed)
    flag.unlink()
    redriven = partq(fleet, "dlq", "redrive", stream, "--group", "audit", "--dead-letters")
    assert redriven.returncode == 0, redriven.stderr + fleet.logs()
    # Then the audit group handles them once, in order, and the default group not again
    wait_until(lambda: len(auditing.records()) == 4, 60, 0.2, "the redriven letters handled")
    assert [r["seq"] for r in auditing.records()] == list(range(4))
    assert len(fleet.records()) == 4
    assert audit.order_violations(fleet.records()) == []


def test_the_group_commands_refuse_what_would_lose_messages(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    fleet = quorum_fleet(2)
    stream = fleet.stream
    # A group of a stream that does not exist, a bad name and the default group: one line
    missing = partq(fleet, "group", "create", f"{stream}-nope", "g")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    bad = partq(fleet, "group", "create", stream, "Bad~Name")
    assert bad.returncode == 2 and "invalid group name" in bad.stderr
    default = partq(fleet, "group", "delete", stream, "default", "--yes")
    assert default.returncode == 2 and "partq stream delete" in default.stderr
    # Consuming a group that was never created names the command that creates it
    absent = partq(fleet, "consume", stream, "--group", "nope", "--handler", "json:dumps")
    assert absent.returncode == 1 and f"partq group create {stream} nope" in absent.stderr
    # A group with a live member is not deleted without --force
    assert partq(fleet, "group", "create", stream, "live").returncode == 0
    live = group_fleet(fleet, "live")
    live.consumer("l1")
    scope = live.stream
    wait_until(
        lambda: registry.client.get(keys.member(scope, "l1"))[0] is not None, 30, 0.2, "l1 joined"
    )
    described = partq(fleet, "group", "describe", stream, "live")
    assert described.returncode == 0, described.stderr
    assert f"stream {scope}: 2 partitions" in described.stdout and "l1" in described.stdout
    refused = partq(fleet, "group", "delete", stream, "live", "--yes")
    assert refused.returncode == 2 and "1 live members (l1)" in refused.stderr
    # And with --force its queues and keys go, the stream's and the default group's stay
    forced = partq(fleet, "group", "delete", stream, "live", "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert list(registry.client.get_prefix(keys.stream_prefix(scope))) == []
    assert registry.list_groups(stream) == []
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert scan_partition_queues(connection, scope) == []
        assert len(scan_partition_queues(connection, stream)) == 2
