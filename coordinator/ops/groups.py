"""A stream's consumer groups: create, list, delete (``partq group``; docs/groups.md).

A group is a set of partition queues of its own, bound to the stream's exchange under the
same routing keys as every other group's, so one publish reaches each group; and a scope
of etcd keys of its own (:func:`partq.producer.contract.group_scope`). The default group is
the one a stream is created with (the stream's own names); it goes only with the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pika
from partq.coordinator.leader.resizer import read_record
from partq.coordinator.store.group import Group
from partq.producer.contract import DEFAULT_GROUP, StreamSpec, group_scope, validate_group_name
from partq.producer.queue_probes import queue_stats
from partq.producer.registry import Registry
from partq.producer.topology import (
    declare_stream,
    delete_stream,
    route_through_partition_exchanges,
)

from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import UsageError

__all__ = ["GroupSummary", "create_group", "delete_group", "delete_queues", "list_groups"]


@dataclass(frozen=True)
class GroupSummary:
    """One group as ``partq group list`` shows it."""

    group: str
    scope: str
    members: int
    messages: int | None  # ready in its partition queues (None: RabbitMQ not asked)


def create_group(registry: Registry, amqp_url: AmqpURL, stream: str, group: str) -> bool:
    """Record ``group`` and declare its queues, bound under the stream's current layout.
    True if new; running it again declares what is missing. It receives what is published
    from then on. Refused while the stream is resized (its bindings change meanwhile)."""
    validate_group_name(group)
    if group == DEFAULT_GROUP:
        raise UsageError(f"every stream has the group {DEFAULT_GROUP!r}: pick another name")
    spec = registry.read_spec(stream)
    running, _revision = read_record(registry, stream)
    if running is not None and running.running:
        raise UsageError(
            f"stream {stream!r} is being resized: create the group once the resize is done "
            f"(`partq stream describe {stream}` shows it)"
        )
    created = registry.add_group(stream, group)
    with blocking_connection(amqp_url, name=f"partq-group-{stream}") as connection:
        route_through_partition_exchanges(connection, spec)  # one cut for every group
        declare_stream(connection, spec.in_group(group))
    return created


def list_groups(registry: Registry, amqp_url: AmqpURL | None, stream: str) -> list[GroupSummary]:
    """Every group of ``stream``, the default one first; depths only with ``amqp_url``."""
    spec = registry.read_spec(stream)
    specs = [spec.in_group(g) for g in [DEFAULT_GROUP, *registry.list_groups(stream)]]
    messages: dict[str, int | None] = dict.fromkeys((s.scope for s in specs), None)
    if amqp_url is not None:
        with blocking_connection(amqp_url, name="partq-group-list") as connection:
            for each in specs:
                messages[each.scope] = sum(q.messages or 0 for q in queue_stats(connection, each))
    found = []
    for each in specs:
        state = Group(registry.client, registry.where, each.scope, report=False).snapshot()
        found.append(GroupSummary(each.group, each.scope, len(state.members), messages[each.scope]))
    return found


def delete_group(
    registry: Registry, amqp_url: AmqpURL, stream: str, group: str, *, force: bool = False
) -> None:
    """Delete ``group``'s queues (and their messages) and every etcd key of it. Refused
    while it has live members unless ``force`` (Kafka's rule), and for the default group."""
    if group == DEFAULT_GROUP:
        raise UsageError(
            f"the group {DEFAULT_GROUP!r} goes only with its stream: `partq stream delete {stream}`"
        )
    scope = group_scope(stream, group)
    spec = registry.read_spec(scope)  # StreamNotFound names a missing group
    members = sorted(Group(registry.client, registry.where, scope, report=False).snapshot().members)
    if members and not force:
        raise UsageError(
            f"group {group!r} of {stream!r} has {len(members)} live members "
            f"({', '.join(members[:5])}{'…' if len(members) > 5 else ''}): stop them first, "
            f"or add --force"
        )
    with blocking_connection(amqp_url, name=f"partq-group-{stream}") as connection:
        delete_queues(registry, connection, [spec], exchange=False)
    registry.remove_group(stream, group)


def delete_queues(
    registry: Registry,
    connection: pika.BlockingConnection,
    specs: list[StreamSpec],
    *,
    exchange: bool,
) -> None:
    """Delete the queues and exchanges of each group of ``specs`` (and then the stream's
    exchange with ``exchange``): during a resize, the queues of both layouts."""
    running, _revision = read_record(registry, specs[0].name)
    for number, each in enumerate(specs, 1):
        spec = each
        if running is not None and running.running:
            both = max(running.resize.old.partitions, running.resize.new.partitions)
            spec = replace(each, partitions=max(each.partitions, both))
        parked = Group(registry.client, registry.where, spec.scope, report=False).parked()
        delete_stream(connection, spec, exchange=exchange and number == len(specs))
        channel = connection.channel()
        for record in parked.values():  # the parked keys' own queues
            channel.queue_delete(spec.park_queue(record.key))
        channel.close()
