"""``PARTQ_AMQP_URL`` as a list: connect to the first node that answers, move on when lost.

Given a list whose first entry is a closed port, ``partq stream create``, the producer SDK
and the consumer daemon all work through the second (the machine's broker). Given two
private RabbitMQ nodes A and B (independent, each with the stream's queues), a producer
publishing keyed sequences to A moves to B when A is stopped, republishes what A had not
confirmed, and every confirmed message is found on A (restarted) or B.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry
from partq.producer.topology import declare_stream

from partq.kernel.local import free_port
from partq.kernel.settings import Settings
from tests.rabbit import Install, PrivateRabbit

from .groups.harness import PARTQ, Fleet, balanced, wait_until

pytestmark = [pytest.mark.integration]


def dead_then(url: str) -> str:
    return f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F,{url}"


def test_a_list_whose_first_node_is_down_works_for_every_component(
    registry: Registry, settings: Settings, rabbitmq: str, stream_name: str, tmp_path: Path
) -> None:
    listed = dead_then(rabbitmq)
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, listed, tmp_path / "r.jsonl")
    try:
        # When the stream is created, a consumer runs and the SDK publishes, all given the list
        created = subprocess.run(
            [str(PARTQ), "stream", "create", stream_name, "--partitions", "2"],
            env=fleet._env(), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
        spec = registry.read_spec(stream_name)
        fleet.coordinator()
        consumer = fleet.consumer("c1")
        group = Group(registry.client, registry.where, stream_name)
        wait_until(lambda: balanced(group, 2, {"c1"}), 30, 0.1, "c1 owning the stream")
        with Producer(spec, amqp_url=listed) as producer:
            futures = [producer.publish(f"k{i}", str(i)) for i in range(50)]
            producer.flush(30)
        assert all(f.exception() is None for f in futures)
        # Then every message is handled, and the consumer says which node it uses
        wait_until(lambda: len(fleet.records()) >= 50, 30, 0.1, "all 50 handled")
        port = urllib.parse.urlsplit(rabbitmq).port
        assert f"connected to RabbitMQ at amqp://guest:***@127.0.0.1:{port}" in consumer.tail(300)
    finally:
        fleet.close()
        with contextlib.suppress(Exception):
            admin.delete(registry, rabbitmq, stream_name)


@pytest.fixture
def two_nodes(
    tmp_path: Path, rabbit_install: Install
) -> Iterator[tuple[PrivateRabbit, PrivateRabbit]]:
    nodes = tuple(
        PrivateRabbit(tmp_path / name, name=f"partq{name}", install=rabbit_install)
        for name in ("a", "b")
    )
    try:
        for node in nodes:
            node.start()
        yield nodes  # type: ignore[misc]
    finally:
        for node in nodes:
            node.stop()


def url_of(node: PrivateRabbit) -> str:
    return node.url


def drain_ids(url: str, spec: StreamSpec) -> set[str]:
    """Every message id left in the stream's queues on one node (consumed, acked)."""
    ids: set[str] = set()
    with pika.BlockingConnection(pika.URLParameters(url)) as connection:
        channel = connection.channel()
        for partition in range(spec.partitions):
            for _ in range(100_000):
                method, props, _body = channel.basic_get(spec.queue(partition), auto_ack=True)
                if method is None:
                    break
                ids.add(props.message_id)
    return ids


@pytest.mark.slow
@pytest.mark.fault
def test_the_producer_moves_to_the_next_node_and_loses_nothing(
    two_nodes: tuple[PrivateRabbit, PrivateRabbit], stream_name: str
) -> None:
    a, b = two_nodes
    spec = StreamSpec(stream_name, 2, "classic")  # basic.get (to count) works on classic SAC
    for node in (a, b):
        with pika.BlockingConnection(pika.URLParameters(url_of(node))) as connection:
            declare_stream(connection, spec)
    confirmed: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def done(message_id: str) -> Callable[[Any], None]:
        def record(future: Any) -> None:
            if future.exception() is None:
                with lock:
                    confirmed.add(message_id)

        return record

    producer = Producer(spec, amqp_url=f"{url_of(a)},{url_of(b)}", reconnect_timeout=60)

    def publish() -> None:
        for n in range(100_000):
            if stop.is_set():
                return
            message_id = f"m{n}"
            producer.publish(f"k{n % 20}", str(n), message_id=message_id).add_done_callback(
                done(message_id)
            )

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        # Given the producer confirmed messages on A, when A stops
        wait_until(lambda: len(confirmed) > 500, 30, 0.05, "confirms from A")
        a.stop(keep_data=True)
        at_stop = len(confirmed)
        # Then it goes on with B
        wait_until(lambda: len(confirmed) > at_stop + 500, 60, 0.1, "confirms from B")
    finally:
        stop.set()
        thread.join(30)
        producer.close(60)
    # And every confirmed message is on A (restarted) or on B
    a.start()
    found = drain_ids(url_of(a), spec) | drain_ids(url_of(b), spec)
    assert sorted(confirmed - found) == []
