"""A consumer group's names (docs/groups.md): its scope, queues, etcd keys and roles reach
its own things and no other group's."""

from __future__ import annotations

import re

import pytest
from partq.coordinator.ops.rights import roles
from partq.coordinator.store import codec
from partq.coordinator.store.kinds import kind_of
from partq.producer.contract import (
    HEADER_GROUP,
    StreamSpec,
    group_scope,
    refuse_control_headers,
    split_scope,
)

from partq.kernel import keys
from partq.kernel.errors import InvalidStreamName, MalformedValue, UsageError

SPEC = StreamSpec("orders", 4)
BILLING = SPEC.in_group("billing")


def test_the_default_group_keeps_the_streams_names() -> None:
    assert group_scope("orders") == group_scope("orders", "default") == "orders"
    assert SPEC.scope == "orders" and SPEC.queue(3) == "partq.orders.p00003"
    assert SPEC.dead_letter_queue == "partq.orders.dlq"
    assert keys.member("orders", "c1") == "/partq/v1/streams/orders/members/c1"


def test_another_group_has_names_of_its_own_and_the_streams_exchange_spec_and_resize() -> None:
    assert BILLING.scope == "orders~billing" and split_scope("orders~billing") == (
        "orders",
        "billing",
    )
    assert BILLING.queue(3) == "partq.orders~billing.p00003"
    assert BILLING.dead_letter_queue == "partq.orders~billing.dlq"
    assert BILLING.park_queue("k").startswith("partq.orders~billing.park.")
    assert BILLING.exchange == SPEC.exchange == "partq.orders"
    assert keys.spec(BILLING.scope) == keys.spec("orders")
    assert keys.resize(BILLING.scope) == keys.resize("orders")
    assert keys.claim(BILLING.scope, 0) == "/partq/v1/streams/orders~billing/claims/00000"
    # one group's prefix is never under another's
    assert not keys.claim(BILLING.scope, 0).startswith(keys.stream_prefix("orders"))
    # the spec is the stream's: stored without the group, read back for the group asked
    assert BILLING.to_json() == SPEC.to_json()
    assert codec.decode_spec(BILLING.scope, "", SPEC.to_json(), 0) == BILLING
    found = kind_of(BILLING.scope, keys.spec("orders"))
    assert found is not None and found[0].kind == "spec"


@pytest.mark.parametrize(
    "scope", ["orders~", "orders~default", "orders~Bad", "~billing", "orders~a~b", "orders~x.dlq"]
)
def test_a_scope_that_names_no_group_is_refused(scope: str) -> None:
    with pytest.raises(InvalidStreamName):
        split_scope(scope)


def test_a_spec_of_another_stream_is_not_a_groups() -> None:
    with pytest.raises(MalformedValue):
        codec.decode_spec("orders~billing", "", StreamSpec("other", 4).to_json(), 0)


def test_producers_may_not_address_one_group() -> None:
    with pytest.raises(UsageError, match=HEADER_GROUP):
        refuse_control_headers({HEADER_GROUP: "billing"})


def _matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None


def test_a_groups_roles_reach_its_queues_and_keys_alone() -> None:
    found = {r.component: r for r in roles("orders~billing")}
    # no producer or admin of its own: the stream's serve every group
    assert set(found) == {"consumer", "coordinator", "operator"}
    consumer = found["consumer"]
    assert consumer.name == "partq-orders~billing-consumer"
    assert _matches(consumer.amqp.read, "partq.orders~billing.p00001")
    for other in ("partq.orders.p00001", "partq.orders~audit.p00001", "partq.orders.dlq"):
        assert not _matches(consumer.amqp.read, other)
    assert not _matches(found["operator"].amqp.read, "partq.orders.dlq")
    # etcd: its own prefix, and the stream's spec, resize and its group record, key by key
    readable = {(e.key, e.prefix) for e in consumer.etcd if "read" in e.permission}
    assert (keys.stream_prefix("orders~billing"), True) in readable
    assert (keys.spec("orders"), False) in readable
    assert (keys.group_record("orders", "billing"), False) in readable
    assert all(not (p and keys.stream_prefix("orders").startswith(k)) for k, p in readable)


def test_the_streams_admin_reaches_every_groups_queues() -> None:
    admin = next(r for r in roles("orders") if r.component == "admin")
    for name in ("partq.orders~billing.p00001", "partq.orders~billing.dlq", "partq.orders.p00001"):
        assert _matches(admin.amqp.configure, name)
    assert not _matches(admin.amqp.configure, "partq.ordersx~billing.p00001")
    assert any(e.key == keys.group_scopes("orders") and e.prefix for e in admin.etcd)
