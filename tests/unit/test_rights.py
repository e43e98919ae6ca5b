"""The least-privilege roles: pure data, checked against the key layout and queue names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from partq.coordinator.ops import rights
from partq.producer.contract import (
    dead_letter_exchange,
    dead_letter_queue,
    exchange_name,
    park_exchange,
    queue_name,
)

from partq.kernel import keys
from partq.kernel.errors import InvalidMemberId, InvalidStreamName, UsageError


def _role(found: list[rights.Role], name: str) -> rights.Role:
    return next(r for r in found if r.name == name)


def _may_write(role: rights.Role, key: str) -> bool:
    return any(
        r.permission != "read" and (key.startswith(r.key) if r.prefix else key == r.key)
        for r in role.etcd
    )


def _matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None


def test_each_component_writes_only_its_own_keys() -> None:
    found = rights.roles("orders", ["c-1", "c-2"])
    c1, coordinator = (
        _role(found, "partq-orders-consumer-c-1"),
        _role(found, "partq-orders-coordinator"),
    )
    producer, operator = (
        _role(found, "partq-orders-producer"),
        _role(found, "partq-orders-operator"),
    )
    assert _may_write(c1, keys.member("orders", "c-1"))
    assert _may_write(c1, keys.claim("orders", 7))
    assert not _may_write(c1, keys.member("orders", "c-2"))
    assert not _may_write(c1, keys.assignment("orders", 7))
    assert not _may_write(c1, keys.spec("orders"))
    assert _may_write(coordinator, keys.assignment("orders", 7))
    assert _may_write(coordinator, keys.claim("orders", 7))  # it deletes forged claims
    assert not any(r.permission != "read" for r in producer.etcd)
    assert [r.key for r in producer.etcd] == [keys.spec("orders"), keys.resize("orders")]
    assert _may_write(operator, keys.request("orders", "x"))
    assert not _may_write(operator, keys.assignment("orders", 0))
    assert "partq-orders-consumer" not in {r.name for r in found}


def test_rabbitmq_patterns_cover_the_stream_and_no_other() -> None:
    found = rights.roles("orders")
    consumer, producer = (
        _role(found, "partq-orders-consumer"),
        _role(found, "partq-orders-producer"),
    )
    admin = _role(found, "partq-orders-admin")
    assert _matches(consumer.amqp.read, queue_name("orders", 3))
    assert not _matches(consumer.amqp.read, queue_name("orders.eu", 3))
    assert not _matches(consumer.amqp.read, dead_letter_queue("orders"))
    assert _matches(consumer.amqp.write, dead_letter_exchange("orders"))
    assert not _matches(consumer.amqp.write, "amq.default")
    assert _matches(producer.amqp.write, exchange_name("orders"))
    assert not _matches(producer.amqp.write, exchange_name("orders.eu"))
    for name in (exchange_name("orders"), dead_letter_queue("orders"), queue_name("orders", 0)):
        assert _matches(admin.amqp.configure, name)
    assert not _matches(admin.amqp.configure, queue_name("other", 0))
    assert not _matches(admin.amqp.write, "amq.default")


def test_bad_stream_or_member_is_refused() -> None:
    with pytest.raises(UsageError):
        rights.roles("Bad Name")
    with pytest.raises(InvalidMemberId):
        rights.roles("orders", ["<script>"])


@pytest.mark.parametrize(
    ("name", "conflict"),
    [
        ("orders.p00001", "partq.orders.p00001 is the name of its partition queue"),
        ("orders.dlq", "partq.orders.dlq is the name of its dead-letter queue"),
        ("orders.dlx", "partq.orders.dlx is the name of its dead-letter exchange"),
        ("orders.park.0123456789abcdef", "is the name of its parking queue"),
        ("orders.park", "partq.orders.park is the name of its parking exchange"),
    ],
)
def test_a_stream_named_as_another_streams_queue_gets_no_roles(name: str, conflict: str) -> None:
    with pytest.raises(InvalidStreamName) as refused:
        rights.roles(name)
    assert f"stream name {name!r} overlaps stream 'orders': " in str(refused.value)
    assert conflict in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["orders.eu", "orders.p1", "orders.dlq2", "dlq", "p00001"])
def test_names_that_overlap_nothing_get_roles(name: str) -> None:
    assert len(rights.roles(name)) == 5


def test_no_two_streams_rights_reach_each_others_names() -> None:
    # Given streams whose names extend each other (not by a reserved suffix)
    names = ["orders", "orders.eu", "orders.p1", "orders.parks", "orders.park.x", "orders.d"]
    resources = {
        n: {exchange_name(n), dead_letter_exchange(n), dead_letter_queue(n), queue_name(n, 1)}
        | {park_exchange(n), f"partq.{n}.park.0123456789abcdef"}
        for n in names
    }
    # Then no role of one stream may touch a name of another
    for name in names:
        for role in rights.roles(name):
            patterns = (role.amqp.configure, role.amqp.write, role.amqp.read)
            for other in names:
                if other != name:
                    reached = {r for r in resources[other] for p in patterns if _matches(p, r)}
                    assert reached == set(), (role.name, other, reached)


def test_the_rabbitmq_table_in_the_security_doc_is_what_roles_grant() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    table = rights.amqp_table()
    assert table in doc, f"docs/security.md must hold this table:\n{table}"
    assert "| operator | \u2013 | `^(partq\\.orders)$` | `^(partq\\.orders\\.dlq)$` |" in table
