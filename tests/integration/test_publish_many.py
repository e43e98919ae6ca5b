"""``Producer.publish_many``: a batch keeps publish's order, window and per-message outcomes."""

from __future__ import annotations

import collections
import threading
import time

import pika
import pytest
from partq.producer import MessageUnroutable, Producer, ProducerClosed, UsageError, partition_for
from partq.producer.contract import QueueType
from partq.producer.publisher import BatchItem

from tests.integration.test_producer import (
    MakeStream,
    P,
    drain,
    make_stream,
    settle,
    unbound_partition,
)

__all__ = ["make_stream"]  # the fixture, used by name

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_a_batch_arrives_in_order_with_its_ids_and_headers(
    make_stream: MakeStream, rabbitmq: str, queue_type: QueueType
) -> None:
    # Given a producer whose window (50) is smaller than each batch (300)
    spec = make_stream(P, queue_type)
    keys = [f"user-{i}" for i in range(60)]
    with Producer(spec, amqp_url=rabbitmq, window=50) as producer:
        # When 3,000 messages go in batches, some with their own headers and message id
        futures = []
        for batch in range(10):
            items = [
                (key, f"{key}:{batch * 5 + seq}".encode(), {"seq": batch * 5 + seq}, None)
                if seq % 2
                else (key, f"{key}:{batch * 5 + seq}".encode(), None, f"id-{batch}-{seq}-{key}")
                for seq in range(5)
                for key in keys
            ]
            futures += producer.publish_many(items)
        producer.flush(timeout=60)
    # Then every future confirmed, in the batch's order, with its key's partition and id
    assert len(futures) == 3000
    receipts = [f.result(timeout=0) for f in futures]
    expected_keys = [key for _batch in range(10) for _seq in range(5) for key in keys]
    assert [r.partition for r in receipts] == [partition_for(k, P) for k in expected_keys]
    assert receipts[0].message_id == f"id-0-0-{keys[0]}"
    # And each key's messages sit in its queue in publish order, headers intact
    delivered = drain(rabbitmq, spec)
    assert len(delivered) == 3000
    seqs: dict[str | bytes | None, list[int]] = collections.defaultdict(list)
    for d in delivered:
        key, seq = d.body.decode().rsplit(":", 1)
        assert d.key == key and d.queue == spec.queue(partition_for(key, P))
        seqs[key].append(int(seq))
    assert all(s == list(range(50)) for s in seqs.values())


def test_a_batch_carries_each_messages_own_headers(make_stream: MakeStream, rabbitmq: str) -> None:
    # Given a batch whose messages carry headers of their own (as the Spark sink's do)
    spec = make_stream(1, "classic")
    items: list[BatchItem] = [
        ("k", f"{i}".encode(), {"partq-seq": i, "tag": f"t{i}"}, f"m-{i}") for i in range(3)
    ]
    items.append(("k", b"3", {"partq-seq": 3, "tag": "t3"}))  # no id: the SDK makes one
    with Producer(spec, amqp_url=rabbitmq) as producer:
        settle(producer.publish_many(items), timeout=30)
    # Then each arrives with its own headers and id, beside partq's
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    try:
        channel = connection.channel()
        for i in range(4):
            _method, properties, body = channel.basic_get(spec.queue(0), auto_ack=True)
            assert body == f"{i}".encode() and properties.message_id
            assert i == 3 or properties.message_id == f"m-{i}"
            assert properties.headers["partq-seq"] == i and properties.headers["tag"] == f"t{i}"
            assert properties.headers["partq-key"] == "k"
    finally:
        connection.close()


def test_an_unroutable_message_fails_only_its_own_future(
    make_stream: MakeStream, rabbitmq: str
) -> None:
    # Given a stream whose partition 3 queue was unbound from the exchange
    spec, keys, lost_keys = unbound_partition(make_stream, rabbitmq)
    lost = set(lost_keys)
    # When a batch holds a key of every partition
    with Producer(spec, amqp_url=rabbitmq) as producer:
        futures = producer.publish_many((key, key.encode()) for key in keys)
        producer.flush(timeout=30)
    # Then the messages of partition 3 alone fail, as unroutable
    for key, future in zip(keys, futures, strict=True):
        error = future.exception(timeout=0)
        if key in lost:
            assert isinstance(error, MessageUnroutable) and "partition 3" in str(error)
        else:
            assert error is None
    # And the others arrived
    assert sorted(d.key for d in drain(rabbitmq, spec)) == sorted(set(keys) - lost)  # type: ignore[type-var]


def test_a_bad_message_refuses_the_whole_batch_before_any_is_sent(
    make_stream: MakeStream, rabbitmq: str
) -> None:
    # Given a batch whose third message has a header AMQP cannot carry
    spec = make_stream(P, "classic")
    items = [("a", b"1", None, None), ("b", b"2", None, None), ("c", b"3", {"n": 2**64}, None)]
    with Producer(spec, amqp_url=rabbitmq) as producer:
        # When it is published, then publish_many raises, naming the header
        with pytest.raises(UsageError, match="header 'n'"):
            producer.publish_many(items)
        with pytest.raises(TypeError):
            producer.publish_many([("a", 5)])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="not 5 items"):
            producer.publish_many([("a", b"1", None, None, None)])  # type: ignore[list-item]
        # And nothing of it was queued: the next message is the only one that arrives
        producer.publish("d", b"4").result(timeout=10)
    assert [d.body for d in drain(rabbitmq, spec)] == [b"4"]


def test_a_closed_producer_refuses_a_batch_and_a_blocked_batch_fails_its_rest(
    make_stream: MakeStream, rabbitmq: str
) -> None:
    # Given a producer with a window of 5
    spec = make_stream(P, "classic")
    producer = Producer(spec, amqp_url=rabbitmq, window=5)
    # When a batch of 50,000 is being published while another thread closes it
    result: list[object] = []

    def publish() -> None:
        try:
            result.append(producer.publish_many([("k", b"x")] * 50_000))
        except ProducerClosed as e:
            result.append(e)

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    wait_for_messages(rabbitmq, spec.queue(partition_for("k", P)))
    producer.close(timeout=0)
    publisher.join(30)
    assert not publisher.is_alive()
    # Then it returned a future for every message: confirmed ones first, then failures
    (futures,) = result
    assert isinstance(futures, list) and len(futures) == 50_000
    settle(futures, timeout=30)
    errors = [f.exception(timeout=0) for f in futures]
    assert errors[0] is None and isinstance(errors[-1], ProducerClosed)
    first_failure = next(i for i, e in enumerate(errors) if e is not None)
    assert all(isinstance(e, ProducerClosed) for e in errors[first_failure:])
    # And a batch on the closed producer is refused outright
    with pytest.raises(ProducerClosed):
        producer.publish_many([("k", b"x")])


def wait_for_messages(rabbitmq: str, queue: str, timeout: float = 30) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    try:
        channel = connection.channel()
        deadline = time.monotonic() + timeout
        while channel.queue_declare(queue, passive=True).method.message_count == 0:
            assert time.monotonic() < deadline, f"nothing arrived in {queue}"
            time.sleep(0.01)
    finally:
        connection.close()
