"""The least-privilege roles: pure data, checked against the key layout and queue names."""

from __future__ import annotations

import re

import pytest

from coordinator import rights
from kernel import keys
from kernel.errors import InvalidMemberId, UsageError
from producer.contract import dead_letter_exchange, dead_letter_queue, exchange_name, queue_name


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
    assert [r.key for r in producer.etcd] == [keys.spec("orders")]
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
