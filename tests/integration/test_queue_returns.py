"""Partition queues keep per-key order when a delivery is given back, and never drop one.

A delivery that races a ``basic.cancel`` is returned to its queue. Measured on
RabbitMQ 3.10 (issue 8): with a quorum queue *without* a delivery limit, the
broker-side return of such a delivery is re-appended at the back (93 reorders
in 292k handoff messages), with a limit it goes to the head (0 in 170k); a
client's own nack goes to the head either way (pinned below). RabbitMQ 4.0+
drops a message after its default delivery limit (20) unless it is
dead-lettered. partq therefore declares quorum partition queues with an
explicit limit and dead-lettering to the stream's DLQ; the reorder itself is
measured by ``benchmarks.handoff_order`` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
from partq.consumers.broker.deadletters import DeadLetters
from partq.consumers.broker.port import Delivery
from partq.producer.contract import QUORUM_DELIVERY_LIMIT, StreamSpec
from partq.producer.queue_arguments import queue_arguments
from partq.producer.topology import declare_stream, delete_stream

pytestmark = [pytest.mark.integration]


@pytest.fixture
def connection(rabbitmq: str) -> Iterator[pika.BlockingConnection]:
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        yield connection


@pytest.fixture(params=["quorum", "classic"])
def spec(
    request: pytest.FixtureRequest, connection: pika.BlockingConnection, stream_name: str
) -> Iterator[StreamSpec]:
    spec = StreamSpec(stream_name, 1, request.param)
    declare_stream(connection, spec)
    yield spec
    delete_stream(connection, spec)


def _publish(
    channel: pika.adapters.blocking_connection.BlockingChannel, spec: StreamSpec, seqs: range
) -> None:
    for seq in seqs:
        channel.basic_publish(
            spec.exchange, "0", str(seq).encode(), pika.BasicProperties(delivery_mode=2)
        )


def _read(
    channel: pika.adapters.blocking_connection.BlockingChannel, queue: str, count: int
) -> list[int]:
    seen: list[int] = []
    for method, _props, body in channel.consume(queue, inactivity_timeout=5):
        if method is None:
            break
        seen.append(int(body))
        channel.basic_ack(method.delivery_tag)
        if len(seen) == count:
            break
    channel.cancel()
    return seen


def test_a_returned_delivery_goes_back_to_the_head(
    spec: StreamSpec, connection: pika.BlockingConnection
) -> None:
    # Given messages 0..9 of one key, all delivered to a first consumer
    channel = connection.channel()
    channel.confirm_delivery()
    _publish(channel, spec, range(10))
    first = connection.channel()
    first.basic_qos(prefetch_count=10)
    delivered = []
    for method, _props, body in first.consume(spec.queue(0), inactivity_timeout=5):
        assert method is not None, "the first consumer got fewer than 10 messages"
        delivered.append((method.delivery_tag, int(body)))
        if len(delivered) == 10:
            break
    # When it handles 1..9 but gives 0 back (as the broker does with a delivery that races
    # a cancel), and newer messages of the key arrive meanwhile
    for tag, seq in delivered:
        if seq == 0:
            first.basic_nack(tag, requeue=True)
        else:
            first.basic_ack(tag)
    first.cancel()
    first.close()
    _publish(channel, spec, range(10, 15))
    # Then the next reader gets 0 before every newer message
    assert _read(connection.channel(), spec.queue(0), 6) == [0, 10, 11, 12, 13, 14]


def test_a_quorum_partition_queue_dead_letters_at_its_delivery_limit(
    connection: pika.BlockingConnection, stream_name: str
) -> None:
    # Given a quorum partition queue and a message that is given back again and again
    spec = StreamSpec(stream_name, 1, "quorum")
    declare_stream(connection, spec)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        _publish(channel, spec, range(1))
        reader = connection.channel()
        reader.basic_qos(prefetch_count=1)
        returns = 0
        # When it is returned QUORUM_DELIVERY_LIMIT + 1 times (bounded loop)
        for method, _props, _body in reader.consume(spec.queue(0), inactivity_timeout=2):
            if method is None:
                break
            reader.basic_nack(method.delivery_tag, requeue=True)
            returns += 1
            if returns > QUORUM_DELIVERY_LIMIT + 5:
                break
        reader.cancel()
        # Then the broker stopped delivering it after the limit and dead-lettered it to the
        # stream's DLQ instead of dropping it
        assert returns == QUORUM_DELIVERY_LIMIT + 1
        dead = connection.channel()
        method, props, body = dead.basic_get(spec.dead_letter_queue, auto_ack=True)
        assert method is not None, "the message was dropped, not dead-lettered"
        assert body == b"0"
        assert props.headers["x-death"][0]["reason"] == "delivery_limit"
    finally:
        delete_stream(connection, spec)


def test_queues_of_an_older_partq_are_kept_and_the_upgrade_is_named(
    connection: pika.BlockingConnection, stream_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a quorum partition queue declared as partq 0.1.0 did (no delivery limit)
    spec = StreamSpec(stream_name, 2, "quorum")
    old = connection.channel()
    old.queue_declare(
        spec.queue(0),
        durable=True,
        arguments={"x-single-active-consumer": True, "x-queue-type": "quorum"},
    )
    old.close()
    try:
        # When the stream is declared by this partq
        with caplog.at_level(logging.WARNING, logger="partq.amqp"):
            declare_stream(connection, spec)
        # Then the old queue stays (arguments cannot change), the new one has the limit,
        # and the warning names the policy command that upgrades the old one
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert "1 queues of stream" in warning
        assert "rabbitmqctl set_policy --apply-to queues" in warning
        assert f'"delivery-limit":{QUORUM_DELIVERY_LIMIT}' in warning
        check = connection.channel()
        for partition in range(2):
            check.queue_declare(spec.queue(partition), passive=True)
    finally:
        delete_stream(connection, spec)


def test_queues_of_partq_0_2_dead_lettering_through_the_default_exchange_are_accepted(
    connection: pika.BlockingConnection,
    rabbitmq: str,
    stream_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a quorum partition queue as partq 0.2 declared it (delivery limit, dead letters
    # through the default exchange) and a stream made before the dead-letter exchange
    spec = StreamSpec(stream_name, 2, "quorum")
    old = connection.channel()
    arguments = {**queue_arguments(spec), "x-dead-letter-exchange": ""}
    old.queue_declare(spec.queue(0), durable=True, arguments=arguments)
    old.close()
    try:
        # When the stream is declared by this partq
        with caplog.at_level(logging.WARNING, logger="partq.amqp"):
            declare_stream(connection, spec)
        # Then it is taken as it is, without a warning (it has its limit and its DLQ)
        assert "queues of stream" not in " ".join(r.getMessage() for r in caplog.records)
        # and a dead letter of a consumer reaches the DLQ through the stream's exchange,
        body = _dead_letter(connection, rabbitmq, spec)
        assert body == b"poison"
        # or, for a stream still without that exchange, through the default one (warned)
        connection.channel().exchange_delete(spec.dead_letter_exchange)
        with caplog.at_level(logging.WARNING, logger="partq.consumer.worker"):
            assert _dead_letter(connection, rabbitmq, spec) == b"poison"
        assert "run `partq stream create" in caplog.text
    finally:
        delete_stream(connection, spec)


def _dead_letter(connection: pika.BlockingConnection, url: str, spec: StreamSpec) -> bytes:
    """Dead-letter one message the way a consumer does; what the DLQ then holds."""
    props = pika.BasicProperties(message_id="m-1", headers={"partq-key": "k"})
    delivery = Delivery(0, None, 1, False, props, b"poison")  # type: ignore[arg-type]
    DeadLetters(url, spec, "m").publish(delivery, ValueError("bad"), 3)
    method, props, body = connection.channel().basic_get(spec.dead_letter_queue, auto_ack=True)
    assert method is not None and props.headers["x-partq-attempts"] == 3
    return bytes(body)
