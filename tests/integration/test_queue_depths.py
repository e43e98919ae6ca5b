"""partq.coordinator.ops.probes.QueueDepths against the real RabbitMQ: one connection, a bounded
refresh,
a reconnect after the broker closes it, a cached failure when it cannot be reached."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pytest
from partq.coordinator.ops import probes
from partq.coordinator.ops.probes import QueueDepths
from partq.producer import BrokerUnavailable, StreamSpec
from partq.producer.topology import declare_stream, delete_stream

from partq.kernel.amqp import blocking_connection
from partq.kernel.local import free_port
from tests.conftest import Ctl

pytestmark = [pytest.mark.integration]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def spec(rabbitmq: str, stream_name: str) -> Iterator[StreamSpec]:
    spec = StreamSpec(stream_name, 3, "classic")
    with blocking_connection(rabbitmq) as connection:
        declare_stream(connection, spec)
    yield spec
    with blocking_connection(rabbitmq) as connection:
        delete_stream(connection, spec)


def publish(amqp_url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish("", queue, b"x", pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def test_refreshes_at_most_once_per_max_age_over_one_connection(
    rabbitmq: str, spec: StreamSpec
) -> None:
    clock = Clock()
    depths = QueueDepths(rabbitmq, name=f"partq-test-{uuid.uuid4().hex[:8]}", clock=clock)
    try:
        first = depths.stats(spec)
        assert [q.messages for q in first] == [0, 0, 0]
        publish(rabbitmq, spec.queue(1))
        clock.now += 1.9  # within max_age: the cached answer
        assert [q.messages for q in depths.stats(spec)] == [0, 0, 0]
        clock.now += 0.2  # past it: refreshed
        assert [q.messages for q in depths.stats(spec)] == [0, 1, 0]
        assert depths.connections_opened == 1
    finally:
        depths.close()


def connection_pid(rabbitmqctl: Ctl, name: str) -> str | None:
    for line in rabbitmqctl("-q", "list_connections", "pid", "client_properties").splitlines():
        if f'{{"connection_name","{name}"}}' in line:
            return line.split("\t", 1)[0]
    return None


def test_reconnects_after_the_broker_closes_its_connection(
    rabbitmq: str, rabbitmqctl: Ctl, spec: StreamSpec
) -> None:
    clock = Clock()
    name = f"partq-test-{uuid.uuid4().hex[:8]}"
    depths = QueueDepths(rabbitmq, name=name, clock=clock)
    try:
        depths.stats(spec)
        pid = connection_pid(rabbitmqctl, name)
        assert pid is not None
        rabbitmqctl("-q", "close_connection", pid, "closed by a partq test")
        clock.now += 5
        assert [q.messages for q in depths.stats(spec)] == [0, 0, 0]
        assert depths.connections_opened == 2
    finally:
        depths.close()


def test_an_unreachable_broker_is_asked_once_per_max_age(
    spec: StreamSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[str] = []
    real = probes.connect_blocking

    def counting(url: str, *, name: str) -> pika.BlockingConnection:
        attempts.append(url)
        return real(url, name=name)

    monkeypatch.setattr(probes, "connect_blocking", counting)
    clock = Clock()
    depths = QueueDepths(f"amqp://guest:pw@127.0.0.1:{free_port()}/%2F", clock=clock)
    for _ in range(3):
        with pytest.raises(BrokerUnavailable, match=r"cannot reach RabbitMQ at .*guest:\*\*\*@"):
            depths.stats(spec)
    assert len(attempts) == 1
    clock.now += 2.0
    with pytest.raises(BrokerUnavailable):
        depths.stats(spec)
    assert len(attempts) == 2
