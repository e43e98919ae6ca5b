"""The producer SDK and stream creation against a real etcd and RabbitMQ.

Every test creates its own stream and deletes it at the end. Queues are drained
with a consumer (quorum queues with single-active-consumer refuse basic.get).
"""

from __future__ import annotations

import collections
import gc
import os
import re
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import pytest
from partq.coordinator.ops import admin
from partq.producer import (
    BrokerUnavailable,
    MessageUnroutable,
    Producer,
    ProducerClosed,
    PublishFailed,
    Receipt,
    SpecMismatch,
    StreamNotFound,
    StreamSpec,
    UsageError,
    partition_for,
    topology,
)
from partq.producer.contract import HEADER_PARTITION, QueueType, decode_key
from partq.producer.registry import Registry
from partq.producer.wire import Framer
from prometheus_client import REGISTRY

from partq.kernel.errors import EtcdUnavailable
from partq.kernel.local import LocalEtcd, free_port
from partq.kernel.settings import Settings
from tests.conftest import Ctl

pytestmark = [pytest.mark.integration]

P = 8
MakeStream = Callable[..., StreamSpec]


@pytest.fixture
def make_stream(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[MakeStream]:
    """Create this test's stream (spec in etcd, queues in RabbitMQ); delete it afterwards."""
    created: list[str] = []

    def make(partitions: int = P, queue_type: QueueType = "quorum") -> StreamSpec:
        spec = StreamSpec(stream_name, partitions, queue_type)
        assert admin.create_stream(registry, rabbitmq, spec) is True
        created.append(spec.name)
        return spec

    yield make
    for name in created:
        admin.delete(registry, rabbitmq, name)


@dataclass(frozen=True)
class Delivered:
    queue: str
    key: str | bytes | None
    partition_header: int
    message_id: str
    body: bytes
    delivery_mode: int


def drain(url: str, spec: StreamSpec, timeout: float = 30.0) -> list[Delivered]:
    """Take every message out of the stream's partition queues, in queue order."""
    delivered: list[Delivered] = []
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        for partition in range(spec.partitions):
            queue = spec.queue(partition)
            expected = channel.queue_declare(queue, passive=True).method.message_count
            got = 0
            deadline = time.monotonic() + timeout
            for method, properties, body in channel.consume(
                queue, auto_ack=True, inactivity_timeout=1.0
            ):
                if got >= expected:
                    break
                if method is None:
                    assert time.monotonic() < deadline, f"{queue}: {got} of {expected} arrived"
                    continue
                headers = properties.headers or {}
                delivered.append(
                    Delivered(
                        queue,
                        decode_key(headers),
                        headers[HEADER_PARTITION],
                        properties.message_id,
                        body,
                        properties.delivery_mode,
                    )
                )
                got += 1
                if got >= expected:
                    break
            channel.cancel()
            left = channel.queue_declare(queue, passive=True).method.message_count
            assert left == 0, f"{queue} still holds {left} messages after draining"
    finally:
        connection.close()
    return delivered


def queue_exists(url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return False
    finally:
        if connection.is_open:
            connection.close()
    return True


def depths(url: str, spec: StreamSpec) -> list[int]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        return [
            channel.queue_declare(spec.queue(p), passive=True).method.message_count
            for p in range(spec.partitions)
        ]
    finally:
        connection.close()


# -- routing: each message in exactly the queue partition_for names, exactly once ---------


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_keyed_messages_land_in_their_partition_exactly_once(
    make_stream: MakeStream, registry: Registry, rabbitmq: str, queue_type: QueueType
) -> None:
    # Given a stream of 8 partitions and 2 000 keys with 5 messages each
    spec = make_stream(P, queue_type)
    keys = [f"user-{i}" for i in range(2000)]
    # When 10 000 messages are published through the Producer, key by key interleaved
    futures: list[tuple[str, int, Future[Receipt]]] = []
    with Producer(spec.name, etcd=registry, amqp_url=rabbitmq, partitions=P) as producer:
        for seq in range(5):
            for key in keys:
                body = f"{key}:{seq}".encode()
                futures.append((key, seq, producer.publish(key, body)))
        # (a publish handed over cannot be taken back: its future refuses to cancel)
        assert futures[0][2].cancel() is False
        producer.flush(timeout=60)
    # Then every future confirmed with the partition partition_for names
    sent_ids: set[str] = set()
    for key, _seq, future in futures:
        receipt = future.result(timeout=0)
        assert receipt.partition == partition_for(key, P)
        sent_ids.add(receipt.message_id)
    assert len(sent_ids) == 10_000
    # And every message sits in that partition's queue, once, persistent, in key order
    delivered = drain(rabbitmq, spec)
    assert len(delivered) == 10_000
    assert {d.message_id for d in delivered} == sent_ids
    seqs_by_key: dict[str | bytes | None, list[int]] = collections.defaultdict(list)
    for d in delivered:
        partition = partition_for(d.key, P) if d.key is not None else -1
        assert d.queue == spec.queue(partition)
        assert d.partition_header == partition
        assert d.delivery_mode == 2
        key, sent_seq = d.body.decode().rsplit(":", 1)
        assert key == d.key
        seqs_by_key[key].append(int(sent_seq))
    assert len(seqs_by_key) == 2000
    assert all(seqs == [0, 1, 2, 3, 4] for seqs in seqs_by_key.values())
    # And the keys are spread over every partition
    assert {d.queue for d in delivered} == {spec.queue(p) for p in range(P)}


# -- create_stream: idempotent, and refuses another partition count ------------------------


def test_create_stream_is_idempotent_and_leaves_queues_unchanged(
    make_stream: MakeStream, registry: Registry, rabbitmq: str
) -> None:
    # Given a created stream with one message in it
    spec = make_stream(P, "quorum")
    with Producer(spec, amqp_url=rabbitmq) as producer:
        receipt = producer.publish("k", b"kept").result(timeout=10)
    # When it is created again with the same spec
    again = admin.create_stream(registry, rabbitmq, StreamSpec(spec.name, P, "quorum"))
    # Then nothing new is created, the message is still there, and no extra queue exists
    assert again is False
    expected = [0] * P
    expected[receipt.partition] = 1
    assert depths(rabbitmq, spec) == expected
    assert not queue_exists(rabbitmq, f"partq.{spec.name}.p{P:05d}")
    assert queue_exists(rabbitmq, spec.dead_letter_queue)
    # And each queue still has its arguments (a redeclare with them is accepted)
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    try:
        channel = connection.channel()
        for p in range(P):
            channel.queue_declare(
                spec.queue(p),
                durable=True,
                arguments=topology.queue_arguments(spec),
            )
    finally:
        connection.close()
    assert registry.read_spec(spec.name) == spec


def test_create_stream_refuses_another_partition_count(
    make_stream: MakeStream, registry: Registry, rabbitmq: str
) -> None:
    # Given a stream stored with 8 partitions
    spec = make_stream(8, "quorum")
    # When it is created again with 12
    with pytest.raises(SpecMismatch) as caught:
        admin.create_stream(registry, rabbitmq, StreamSpec(spec.name, 12, "quorum"))
    # Then the error names both values
    message = str(caught.value)
    assert "8 partitions" in message
    assert "not 12" in message
    # And nothing was declared for 12 partitions, and etcd still says 8
    assert not queue_exists(rabbitmq, f"partq.{spec.name}.p00008")
    assert not queue_exists(rabbitmq, f"partq.{spec.name}.p00011")
    assert registry.read_spec(spec.name).partitions == 8


def test_create_stream_refuses_another_queue_type(
    make_stream: MakeStream, registry: Registry, rabbitmq: str
) -> None:
    # Given a quorum stream
    spec = make_stream(P, "quorum")
    # When it is created again as classic
    with pytest.raises(SpecMismatch) as caught:
        admin.create_stream(registry, rabbitmq, StreamSpec(spec.name, P, "classic"))
    # Then the error names both queue types and the stored spec is unchanged
    assert "quorum" in str(caught.value)
    assert "classic" in str(caught.value)
    assert registry.read_spec(spec.name) == spec


# -- refusals: unknown stream, wrong partitions, etcd down, broker down, unroutable --------


def test_unknown_stream_is_refused(registry: Registry, rabbitmq: str, stream_name: str) -> None:
    # Given a stream name that was never created
    # When a producer is made for it
    with pytest.raises(StreamNotFound) as caught:
        Producer(stream_name, etcd=registry, amqp_url=rabbitmq)
    # Then the error says how to create it
    assert f"partq stream create {stream_name}" in str(caught.value)


def test_wrong_partition_count_is_refused_before_connecting(
    make_stream: MakeStream, registry: Registry, rabbitmq: str
) -> None:
    # Given a stream of 8 partitions and a broker URL nothing listens on
    spec = make_stream(P, "quorum")
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"
    threads_before = threading.active_count()
    # When a producer is configured with 12 partitions
    with pytest.raises(SpecMismatch) as caught:
        Producer(spec.name, etcd=registry, amqp_url=closed, partitions=12)
    # Then it is refused with both counts before any connection was tried
    # (a connection attempt would have raised BrokerUnavailable), and no I/O thread started
    assert "8 partitions" in str(caught.value)
    assert "12 were configured" in str(caught.value)
    assert threading.active_count() == threads_before
    # And the same against the real broker leaves every queue empty
    with pytest.raises(SpecMismatch):
        Producer(spec.name, etcd=registry, amqp_url=rabbitmq, partitions=7)
    assert depths(rabbitmq, spec) == [0] * P


def test_etcd_down_at_connect_is_etcd_unavailable() -> None:
    # Given an etcd endpoint nothing listens on
    settings = Settings.load(etcd_endpoints=f"http://127.0.0.1:{free_port()}", etcd_timeout=2)
    # When a registry connects to it
    with pytest.raises(EtcdUnavailable) as caught:
        Registry.connect(settings)
    # Then the error asks whether etcd is running
    assert "is it running" in str(caught.value)


def test_etcd_down_when_the_producer_reads_the_spec(rabbitmq: str, stream_name: str) -> None:
    # Given a registry connected to an etcd that then stops
    with LocalEtcd() as etcd:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint, etcd_timeout=2))
    try:
        # When a producer reads its stream's spec
        with pytest.raises(EtcdUnavailable) as caught:
            Producer(stream_name, etcd=registry, amqp_url=rabbitmq)
        # Then it fails with EtcdUnavailable asking whether etcd is running
        assert "is it running" in str(caught.value)
    finally:
        registry.close()


def test_broker_down_is_broker_unavailable(stream_name: str) -> None:
    # Given a broker URL nothing listens on (with a password in it)
    port = free_port()
    url = f"amqp://guest:s3cret-pw@127.0.0.1:{port}/%2F"
    name = f"down-{uuid.uuid4().hex[:8]}"
    # When a producer is made
    with pytest.raises(BrokerUnavailable) as caught:
        Producer(StreamSpec(stream_name, P), amqp_url=url, connect_timeout=3, name=name)
    # Then it asks whether RabbitMQ is running, names the port, hides the password
    message = str(caught.value)
    assert "is it running" in message
    assert str(port) in message
    assert "s3cret-pw" not in message
    # And its I/O thread has ended
    deadline = time.monotonic() + 5
    while any(t.name == f"{name}-io" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the producer's I/O thread outlived its failure"
        time.sleep(0.05)


def unbound_partition(
    make_stream: MakeStream, rabbitmq: str
) -> tuple[StreamSpec, list[str], list[str]]:
    """A classic stream whose partition 3 queue is unbound from the exchange; 200 keys, and
    those of them that hash to partition 3."""
    spec = make_stream(P, "classic")
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq))
    connection.channel().queue_unbind(spec.queue(3), spec.exchange, routing_key="3")
    connection.close()
    keys = [f"k{i}" for i in range(200)]
    lost_keys = [k for k in keys if partition_for(k, P) == 3]
    assert lost_keys
    return spec, keys, lost_keys


def test_unroutable_partition_fails_and_the_others_confirm(
    make_stream: MakeStream, rabbitmq: str
) -> None:
    # Given a stream whose partition 3 queue was unbound from the exchange
    spec, keys, lost_keys = unbound_partition(make_stream, rabbitmq)
    # When a key of every partition is published
    with Producer(spec, amqp_url=rabbitmq) as producer:
        futures = {key: producer.publish(key, key.encode()) for key in keys}
        producer.flush(timeout=30)
    # Then the keys of partition 3 fail as unroutable, naming the partition
    for key in lost_keys:
        error = futures[key].exception(timeout=0)
        assert isinstance(error, MessageUnroutable)
        assert "partition 3" in str(error)
    # And every other key confirmed and is in its queue
    routed = [k for k in keys if k not in lost_keys]
    assert all(futures[k].exception(timeout=0) is None for k in routed)
    delivered = drain(rabbitmq, spec)
    assert sorted(d.key for d in delivered) == sorted(routed)  # type: ignore[type-var]


# -- connection loss: republish in order, lose nothing that was confirmed -----------------


def connection_pids(rabbitmqctl: Ctl, name: str) -> list[str]:
    out = rabbitmqctl("list_connections", "pid", "client_properties", "-q", timeout=30)
    marker = f'{{"connection_name","{name}"}}'
    return [line.split("\t", 1)[0] for line in out.splitlines() if marker in line]


def close_connection(rabbitmqctl: Ctl, name: str) -> None:
    pids = connection_pids(rabbitmqctl, name)
    assert len(pids) == 1, f"expected one connection named {name}, found {pids}"
    rabbitmqctl("close_connection", pids[0], "test", timeout=30)


@pytest.fixture
def publish_counts(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How many times each message id was handed to the broker (republishes count twice)."""
    counts: collections.Counter[str] = collections.Counter()
    original = Framer.add

    def counting(self: Framer, routing_key: str, properties: bytes, body: bytes) -> None:
        original(self, routing_key, properties, body)
        decoded = pika.BasicProperties()
        decoded.decode(properties)
        counts[decoded.message_id] += 1

    monkeypatch.setattr(Framer, "add", counting)
    return counts


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_connection_loss_loses_nothing_confirmed(
    make_stream: MakeStream,
    rabbitmq: str,
    rabbitmqctl: Ctl,
    queue_type: QueueType,
    publish_counts: collections.Counter[str],
) -> None:
    # Given a producer publishing keyed messages continuously from a thread
    spec = make_stream(P, queue_type)
    name = f"partq-test-{uuid.uuid4().hex[:12]}"
    producer = Producer(spec, amqp_url=rabbitmq, window=200, name=name)
    sent: list[tuple[str, int, Future[Receipt]]] = []
    stop = threading.Event()

    def publish_forever() -> None:
        seq = 0
        while not stop.is_set():
            for k in range(50):
                key = f"key-{k}"
                sent.append((key, seq, producer.publish(key, f"{key}:{seq}".encode())))
            seq += 1

    publisher = threading.Thread(target=publish_forever, daemon=True)
    publisher.start()
    try:
        deadline = time.monotonic() + 20
        while sum(f.done() for _, _, f in list(sent)) < 500:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # When the broker closes the producer's connection under it
        close_connection(rabbitmqctl, name)
        closed_at = len(sent)
        # And publishing goes on until a few thousand more are confirmed
        deadline = time.monotonic() + 30
        while sum(f.done() for _, _, f in sent[closed_at:]) < 1000:
            assert time.monotonic() < deadline, "no confirms after the connection was closed"
            time.sleep(0.05)
    finally:
        stop.set()
        publisher.join(10)
    producer.close(timeout=30)
    # Then every future resolved, and each one successfully (the reconnect was quick)
    futures = [f for _, _, f in sent]
    _done, not_done = wait(futures, timeout=30)
    assert not not_done
    failures = [f.exception() for f in futures if f.exception() is not None]
    assert failures == []
    confirmed_ids = {f.result().message_id for f in futures}
    # And the producer republished what was unconfirmed once, keeping per-key order
    again = assert_republished_in_order(rabbitmq, spec, confirmed_ids, publish_counts, window=200)
    print(f"\n{again} republished after the connection loss")


def assert_republished_in_order(
    rabbitmq: str,
    spec: StreamSpec,
    confirmed_ids: set[str],
    publish_counts: collections.Counter[str],
    window: int,
) -> int:
    """After a connection loss: what was unconfirmed was republished once, every confirmed
    message (``key:seq`` bodies) arrived, and each key's first copies keep publish order;
    how many were republished (0 when the close found the window empty: CI once saw that
    on a classic queue, whose confirms come fast)."""
    # the producer reconnected and republished what was unconfirmed, once each
    republished = {mid for mid, n in publish_counts.items() if n > 1}
    assert len(republished) <= window  # what was in the window when the connection went
    assert max(publish_counts.values()) <= 2
    # every confirmed message is in its queue
    delivered = drain(rabbitmq, spec)
    delivered_ids = collections.Counter(d.message_id for d in delivered)
    assert confirmed_ids <= set(delivered_ids)
    assert len(delivered) >= len(confirmed_ids)
    # the only duplicates are messages that were republished, at most once more
    duplicates = {mid for mid, n in delivered_ids.items() if n > 1}
    assert duplicates <= republished
    assert all(n <= 2 for n in delivered_ids.values())
    # per key, first occurrences keep publish order within the queue
    first_seqs: dict[str | bytes | None, list[int]] = collections.defaultdict(list)
    seen: set[str] = set()
    for d in delivered:
        if d.message_id in seen:
            continue
        seen.add(d.message_id)
        assert d.queue == spec.queue(partition_for(str(d.key), spec.partitions))
        first_seqs[d.key].append(int(d.body.decode().rsplit(":", 1)[1]))
    for key, seqs in first_seqs.items():
        assert seqs == sorted(seqs), f"{key!r} out of order"
        assert len(seqs) == len(set(seqs))
    return len(republished)


# -- backpressure: the window bounds what is unconfirmed ----------------------------------


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so that races show up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_window_bounds_unconfirmed_messages_across_threads(
    make_stream: MakeStream, rabbitmq: str
) -> None:
    # Given a producer with a window of 10
    spec = make_stream(P, "classic")
    producer = Producer(spec, amqp_url=rabbitmq, window=10)
    gauge_labels = {"stream": spec.name}
    peaks = {"outstanding": 0, "gauge": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peaks["outstanding"] = max(peaks["outstanding"], producer._outstanding)
            value = REGISTRY.get_sample_value("partq_producer_in_flight_messages", gauge_labels)
            peaks["gauge"] = max(peaks["gauge"], value or 0.0)
            time.sleep(0)

    results: dict[int, list[Future[Receipt]]] = {}

    def publish_from(thread: int) -> None:
        futures = []
        for i in range(500):
            futures.append(producer.publish(f"t{thread}-k{i % 20}", f"{thread}:{i}".encode()))
            # the publishing thread itself never sees more than the window outstanding
            peaks["outstanding"] = max(peaks["outstanding"], producer._outstanding)
        results[thread] = futures

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # When 4 threads publish 500 messages each at once
    threads = [threading.Thread(target=publish_from, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    producer.flush(timeout=30)
    stop.set()
    watcher.join(5)
    producer.close()
    # Then at no time were more than 10 messages unconfirmed, but the window was used
    assert 1 <= peaks["outstanding"] <= 10
    assert 1 <= peaks["gauge"] <= 10
    # And every message confirmed and arrived exactly once
    futures = [f for t in range(4) for f in results[t]]
    ids = [f.result(timeout=0).message_id for f in futures]
    assert len(set(ids)) == 2000
    delivered = drain(rabbitmq, spec)
    assert sorted(d.message_id for d in delivered) == sorted(ids)
    # And each thread's messages kept their order per key
    by_key: dict[str | bytes | None, list[int]] = collections.defaultdict(list)
    for d in delivered:
        by_key[d.key].append(int(d.body.decode().split(":")[1]))
    assert all(seqs == sorted(seqs) for seqs in by_key.values())


# -- resources: a closed producer leaves no socket behind ---------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_releases_every_socket(make_stream: MakeStream, rabbitmq: str) -> None:
    # Given a stream, and the number of open file descriptors before any producer
    spec = make_stream(P, "classic")
    gc.collect()
    before = open_fds()
    # When producers are opened, used and closed
    for _ in range(3):
        with Producer(spec, amqp_url=rabbitmq) as producer:
            producer.publish("k", b"v").result(timeout=10)
    # Then no descriptor is left open (the I/O loop's wake-up sockets included)
    left_open = open_fds() - before
    # And the garbage collector finds no unclosed socket to warn about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
    assert left_open == 0


# -- poison: what the encoder or the broker cannot take fails that message alone ----------


def settle(futures: list[Future[Receipt]], timeout: float) -> None:
    """Fail, rather than hang, unless every future resolves within ``timeout``."""
    _done, not_done = wait(futures, timeout=timeout)
    assert not not_done, f"{len(not_done)} of {len(futures)} futures unresolved after {timeout}s"


def close_within(producer: Producer, seconds: float) -> None:
    started = time.monotonic()
    producer.close()
    took = time.monotonic() - started
    assert took < seconds, f"close() took {took:.1f}s"


def keyed_around(
    producer: Producer, poison: Callable[[], Future[Receipt]]
) -> tuple[list[Future[Receipt]], Future[Receipt] | UsageError]:
    """Five keyed messages, then ``poison()``, then five more on the same keys."""
    good = [producer.publish(f"k{i}", f"before:{i}") for i in range(5)]
    outcome: Future[Receipt] | UsageError
    try:
        outcome = poison()
    except UsageError as e:
        outcome = e
    good += [producer.publish(f"k{i}", f"after:{i}") for i in range(5)]
    return good, outcome


def assert_the_others_arrived_in_order(
    rabbitmq: str, spec: StreamSpec, publish_counts: collections.Counter[str]
) -> None:
    """Each good message of :func:`keyed_around` arrived, in order per key; a second copy
    only of one that was republished (its confirm lost with the connection)."""
    delivered = drain(rabbitmq, spec)
    bodies: dict[str | bytes | None, list[bytes]] = collections.defaultdict(list)
    seen: set[str] = set()
    for d in delivered:
        if d.message_id in seen:
            assert publish_counts[d.message_id] > 1, f"{d.body!r} arrived twice, sent once"
            continue
        seen.add(d.message_id)
        bodies[d.key].append(d.body)
    assert bodies == {f"k{i}": [f"before:{i}".encode(), f"after:{i}".encode()] for i in range(5)}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"headers": {"n": 2**63}}, ["header 'n'", "64-bit", "str"]),
        ({"headers": {"tags": {"a", "b"}}}, ["header 'tags'", "set"]),
        ({"headers": {"outer": {"inner": [1, 2**64]}}}, ["header 'outer'['inner'][1]", "64-bit"]),
        ({"message_id": "m" * 256}, ["message_id", "256 bytes", "255"]),
    ],
    ids=["int-2**63", "set", "nested-int-2**64", "message-id-256-bytes"],
)
def test_unencodable_message_fails_its_publish_and_the_others_confirm(
    make_stream: MakeStream,
    rabbitmq: str,
    publish_counts: collections.Counter[str],
    kwargs: dict[str, Any],
    expected: list[str],
) -> None:
    # Given a producer
    spec = make_stream(P, "classic")
    producer = Producer(spec, amqp_url=rabbitmq)
    try:
        # When a message pika cannot encode is published between ten good ones
        good, outcome = keyed_around(producer, lambda: producer.publish("k0", b"bad", **kwargs))
        # Then the good ones all confirm (no dead I/O thread, no reconnect loop)
        settle(good, timeout=15)
        assert [f.exception() for f in good] == [None] * 10
        # And that publish call itself was refused at once, saying what is wrong
        assert isinstance(outcome, UsageError), f"accepted: {outcome!r}"
        for part in expected:
            assert part in str(outcome)
        # And close() returns promptly
        close_within(producer, 5)
    finally:
        producer.close(timeout=2)
    # And each good message went out once, and arrived in order per key
    assert sorted(publish_counts.values()) == [1] * 10
    assert_the_others_arrived_in_order(rabbitmq, spec, publish_counts)


def test_key_too_large_for_a_frame_fails_its_publish_and_the_others_confirm(
    make_stream: MakeStream, rabbitmq: str, publish_counts: collections.Counter[str]
) -> None:
    # Given a producer on a connection with the default frame_max of 128 kB
    spec = make_stream(P, "classic")
    producer = Producer(spec, amqp_url=rabbitmq)
    try:
        # When a message with a 140 kB key (its headers cannot fit one frame) is published
        good, outcome = keyed_around(producer, lambda: producer.publish("k" * 140_000, b"big key"))
        # Then the others all confirm
        settle(good, timeout=15)
        assert [f.exception() for f in good] == [None] * 10
        # And that publish call was refused at once, naming the frame limit and the fix
        assert isinstance(outcome, UsageError), f"accepted: {outcome!r}"
        assert "frame_max" in str(outcome)
        assert "shorter key" in str(outcome)
        close_within(producer, 5)
    finally:
        producer.close(timeout=2)
    assert sorted(publish_counts.values()) == [1] * 10
    assert_the_others_arrived_in_order(rabbitmq, spec, publish_counts)


def test_frame_the_broker_refuses_fails_that_future_alone(
    make_stream: MakeStream, rabbitmq: str, publish_counts: collections.Counter[str]
) -> None:
    # Given a producer whose own frame-size check is switched off (white box), so that
    # the broker is the one to refuse an oversized header frame: it closes the connection
    spec = make_stream(P, "classic")
    producer = Producer(spec, amqp_url=rabbitmq)
    producer._max_properties = 1 << 30
    try:
        # When a message with a 140 kB key is published between ten good ones
        good, outcome = keyed_around(
            producer, lambda: producer.publish("k0" * 70_000, b"big key", message_id="big")
        )
        assert isinstance(outcome, Future)
        # Then that future alone fails, naming the cause
        error = outcome.exception(timeout=15)
        assert isinstance(error, PublishFailed)
        assert "frame_max" in str(error)
        # And the producer reconnected and republished the others, which all confirm
        settle(good, timeout=15)
        assert [f.exception() for f in good] == [None] * 10
        close_within(producer, 5)
    finally:
        producer.close(timeout=2)
    # And the refused message was sent once, never republished
    assert publish_counts["big"] == 1
    assert max(publish_counts.values()) <= 2
    assert_the_others_arrived_in_order(rabbitmq, spec, publish_counts)


def broker_max_message_size(rabbitmqctl: Ctl) -> int:
    out = rabbitmqctl("eval", "application:get_env(rabbit, max_message_size).", timeout=30)
    found = re.search(r"\{ok,(\d+)\}", out)
    return int(found.group(1)) if found else 134_217_728  # RabbitMQ 3.8+'s default, 128 MiB


def test_body_above_max_message_size_fails_that_future_alone(
    make_stream: MakeStream,
    rabbitmq: str,
    rabbitmqctl: Ctl,
    publish_counts: collections.Counter[str],
) -> None:
    # Given a producer, and a body one byte above the broker's max_message_size
    # (by default 128 MiB on 3.x, 16 MiB on 4.0: the broker reads all of it, then closes the
    # channel)
    spec = make_stream(P, "classic")
    limit = broker_max_message_size(rabbitmqctl)
    assert limit <= 256 * 1024 * 1024, f"max_message_size {limit} is too large to test here"
    huge = bytes(limit + 1)
    producer = Producer(spec, amqp_url=rabbitmq)
    try:
        # When it is published between ten good ones
        good, outcome = keyed_around(
            producer, lambda: producer.publish("k0", huge, message_id="huge-1")
        )
        assert isinstance(outcome, Future)
        # Then that future alone fails, naming max_message_size and both sizes
        error = outcome.exception(timeout=30)
        assert isinstance(error, PublishFailed)
        assert "max_message_size" in str(error)
        assert str(limit + 1) in str(error)
        assert str(limit) in str(error)
        # And the others all confirm
        settle(good, timeout=30)
        assert [f.exception() for f in good] == [None] * 10
        # And a second body above the limit now fails at once, without being sent
        second = producer.publish("k0", huge, message_id="huge-2")
        assert second.done()
        assert isinstance(second.exception(timeout=0), PublishFailed)
        close_within(producer, 5)
    finally:
        producer.close(timeout=2)
    assert publish_counts["huge-1"] == 1
    assert publish_counts["huge-2"] == 0
    assert_the_others_arrived_in_order(rabbitmq, spec, publish_counts)


def test_io_thread_death_fails_every_publish_and_close_returns(
    make_stream: MakeStream, rabbitmq: str, rabbitmqctl: Ctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a producer with a window of 4 that has confirmed a message
    spec = make_stream(P, "classic")
    name = f"partq-test-{uuid.uuid4().hex[:12]}"
    producer = Producer(spec, amqp_url=rabbitmq, window=4, name=name)
    try:
        producer.publish("k", b"first").result(timeout=10)
        # And pika's publish then fails inside the I/O thread (held until the window is full)
        boom = RuntimeError("boom: pika failed inside the I/O thread")
        release = threading.Event()

        def explode(*args: Any, **kwargs: Any) -> None:
            release.wait(10)
            raise boom

        monkeypatch.setattr(Framer, "add", explode)
        # When four messages fill the window, a fifth publisher blocks on it, and pika fails
        pending = [producer.publish(f"k{i}", b"doomed") for i in range(4)]
        blocked: list[BaseException] = []

        def publish_on_a_full_window() -> None:
            try:
                producer.publish("late", b"late")
            except BaseException as e:
                blocked.append(e)

        publisher = threading.Thread(target=publish_on_a_full_window, daemon=True)
        publisher.start()
        time.sleep(0.2)
        release.set()
        # Then every pending future fails at once with the cause
        for future in pending:
            error = future.exception(timeout=5)
            assert isinstance(error, ProducerClosed)
            assert "boom" in str(error)
            assert error.__cause__ is boom
        # And the blocked publisher and any later publish are refused with the cause
        publisher.join(5)
        assert not publisher.is_alive(), "a publisher stayed blocked on the window"
        assert len(blocked) == 1
        assert isinstance(blocked[0], ProducerClosed)
        with pytest.raises(ProducerClosed, match="boom"):
            producer.publish("later", b"later")
        # And close() returns promptly, and the broker sees the connection closed
        close_within(producer, 5)
        deadline = time.monotonic() + 10
        while connection_pids(rabbitmqctl, name):
            assert time.monotonic() < deadline, "the dead producer's connection stayed open"
            time.sleep(0.2)
    finally:
        release.set()
        producer.close(timeout=2)
