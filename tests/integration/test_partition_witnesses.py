"""Two witnesses of a stream's partition count: the spec in etcd and the queues in RabbitMQ.

The measured bug: etcd lost its data, then ``partq stream create NAME -p 4`` for a stream
that had 8 was accepted; queues p4..p7 kept their messages, which ``status`` and
``describe`` never showed, and producers published with the new count. Here etcd's data
loss is simulated by deleting the stream's keys (``Registry.delete``), which leaves the
queues alone, exactly as a wiped etcd does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from partq.producer import Producer, SpecMismatch, StreamNotFound, StreamSpec
from partq.producer.contract import QueueType
from partq.producer.registry import Registry
from partq.producer.topology import delete_stream

from partq.kernel.amqp import blocking_connection
from partq.kernel.local import LocalEtcd

pytestmark = [pytest.mark.integration]

PARTQ = str(Path(sys.executable).with_name("partq"))
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def partq(etcd_server: LocalEtcd, rabbitmq: str) -> Run:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
        environ["PARTQ_ETCD_ENDPOINTS"] = etcd_server.endpoint
        environ["PARTQ_AMQP_URL"] = rabbitmq
        return subprocess.run(
            [PARTQ, *args], capture_output=True, text=True, env=environ, timeout=60, check=False
        )

    return run


@pytest.fixture
def lost(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[Callable[..., None]]:
    """``lost(P, queue_type, per_queue)``: a stream of P partitions with ``per_queue`` messages
    in each queue, whose spec etcd then lost. Its queues are deleted after the test."""
    made: list[StreamSpec] = []

    def make(partitions: int, queue_type: QueueType = "quorum", per_queue: int = 0) -> None:
        from partq.coordinator.ops import admin

        spec = StreamSpec(stream_name, partitions, queue_type)
        admin.create_stream(registry, rabbitmq, spec)
        made.append(spec)
        if per_queue:
            fill(rabbitmq, spec, per_queue)
        registry.delete(stream_name)  # etcd lost its data; the queues stay

    yield make
    registry.delete(stream_name)
    with blocking_connection(rabbitmq) as connection:
        for spec in made:
            delete_stream(connection, spec)
        channel = connection.channel()
        for p in range(16):  # whatever a failed test may have declared beyond
            channel.queue_delete(f"partq.{stream_name}.p{p:05d}")
        channel.close()


def fill(amqp_url: str, spec: StreamSpec, per_queue: int) -> None:
    """``per_queue`` persistent, confirmed messages straight into every partition queue."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for p in range(spec.partitions):
            for i in range(per_queue):
                channel.basic_publish(
                    "", spec.queue(p), f"m{i}".encode(), pika.BasicProperties(delivery_mode=2)
                )
    finally:
        connection.close()


def depths(amqp_url: str, stream: str, partitions: int) -> list[int | None]:
    out: list[int | None] = []
    with blocking_connection(amqp_url) as connection:
        for p in range(partitions):
            channel = connection.channel()
            try:
                ok = channel.queue_declare(f"partq.{stream}.p{p:05d}", passive=True)
                out.append(ok.method.message_count)
                channel.close()
            except pika.exceptions.ChannelClosedByBroker:
                out.append(None)
    return out


def one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("partq: error: "), lines[0]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# -- stream create: the broker is asked too ---------------------------------------------------


def test_create_with_fewer_partitions_than_the_queues_is_refused_and_adopt_restores(
    partq: Run, lost: Callable[..., None], stream_name: str, registry: Registry, rabbitmq: str
) -> None:
    # Given a stream of 8 partitions, 3 messages in each queue, whose spec etcd lost
    lost(8, "quorum", per_queue=3)
    # When it is created again with 4 partitions
    refused = partq("stream", "create", stream_name, "-p", "4")
    # Then partq exits 2 naming both counts, the messages, and how to recover
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = one_line_error(refused, "8 partition queues", "4 partitions", "24 messages")
    assert f"partq stream create {stream_name} --adopt" in line
    # And nothing was stored, and the queues (and their messages) are as they were
    with pytest.raises(StreamNotFound):
        registry.read_spec(stream_name)
    assert depths(rabbitmq, stream_name, 9) == [3] * 8 + [None]
    # When the spec is restored from the queues
    adopted = partq("stream", "create", stream_name, "--adopt")
    # Then the spec has the queues' count and queue type
    assert adopted.returncode == 0, adopted.stderr
    assert f"stream {stream_name} adopted: 8 partitions, quorum queues" in adopted.stdout
    # (parking, as a new stream: the queues cannot tell; --on-failure chooses)
    assert registry.read_spec(stream_name) == StreamSpec(
        stream_name, 8, "quorum", on_failure="park"
    )
    assert depths(rabbitmq, stream_name, 9) == [3] * 8 + [None]
    # And adopting again changes nothing
    again = partq("stream", "create", stream_name, "--adopt")
    assert again.returncode == 0, again.stderr
    assert "exists, unchanged" in again.stdout


def test_create_with_the_same_count_but_no_spec_is_refused(
    partq: Run, lost: Callable[..., None], stream_name: str, registry: Registry
) -> None:
    # Given the 4 queues of a stream whose spec etcd lost
    lost(4, "quorum")
    # When it is created with 4 partitions, and with 6
    same = partq("stream", "create", stream_name, "-p", "4")
    more = partq("stream", "create", stream_name, "-p", "6")
    # Then both are refused, naming the counts, pointing at --adopt
    for result, asked in ((same, "4"), (more, "6")):
        assert result.returncode == 2, result.stdout + result.stderr
        one_line_error(result, "no spec in etcd", "4 partition queues", f"{asked} partitions")
        assert "--adopt" in result.stderr
    with pytest.raises(StreamNotFound):
        registry.read_spec(stream_name)


def test_adopt_detects_classic_queues_and_checks_the_given_flags(
    partq: Run, lost: Callable[..., None], stream_name: str, registry: Registry
) -> None:
    # Given 3 classic queues without a spec
    lost(3, "classic")
    # When adopted with a wrong --partitions, or a wrong --queue-type
    wrong_count = partq("stream", "create", stream_name, "--adopt", "-p", "5")
    wrong_type = partq("stream", "create", stream_name, "--adopt", "--queue-type", "quorum")
    # Then each is refused naming both values
    assert wrong_count.returncode == 2
    one_line_error(wrong_count, "3 partition queues", "5")
    assert wrong_type.returncode == 2
    one_line_error(wrong_type, "classic", "quorum")
    # When adopted without flags: the classic type is detected
    adopted = partq("stream", "create", stream_name, "--adopt")
    assert adopted.returncode == 0, adopted.stderr
    assert registry.read_spec(stream_name) == StreamSpec(
        stream_name, 3, "classic", on_failure="park"
    )


def test_adopt_with_no_queues_exits_1(partq: Run, stream_name: str) -> None:
    result = partq("stream", "create", stream_name, "--adopt")
    assert result.returncode == 1
    one_line_error(result, f"partq.{stream_name}.p00000 does not exist", "--partitions")


# -- a stale spec: producers refuse, describe and status show the queues beyond ---------------


@pytest.fixture
def stale(lost: Callable[..., None], stream_name: str, registry: Registry) -> Iterator[StreamSpec]:
    """The state the bug left: 8 queues holding 2 messages each, a spec of 4 in etcd."""
    lost(8, "quorum", per_queue=2)
    spec = StreamSpec(stream_name, 4, "quorum")
    registry.create(spec)  # what `partq stream create -p 4` stored before the fix
    yield spec


def test_producer_start_is_refused_when_queues_exist_beyond_the_spec(
    partq: Run, stale: StreamSpec, registry: Registry, rabbitmq: str
) -> None:
    # When a producer starts, in the SDK and from the CLI
    with pytest.raises(SpecMismatch) as caught:
        Producer(stale.name, etcd=registry, amqp_url=rabbitmq).close()
    result = partq("produce", stale.name, "-k", "k", "-b", "b")
    # Then both refuse naming both counts and the first queue beyond, and nothing was sent
    for message in (str(caught.value), result.stderr):
        assert "4 partitions" in message and "8 partition queues" in message, message
        assert f"partq.{stale.name}.p00004" in message, message
        assert "--adopt" in message, message
    assert result.returncode == 2
    one_line_error(result)
    assert depths(rabbitmq, stale.name, 8) == [2] * 8


def test_create_with_the_stale_count_is_refused_and_adopt_names_the_stale_spec(
    partq: Run, stale: StreamSpec, registry: Registry
) -> None:
    # When the stale spec is "created" again, or adopted over
    recreate = partq("stream", "create", stale.name, "-p", "4")
    adopt = partq("stream", "create", stale.name, "--adopt")
    # Then both are refused; adopt names the stale spec's key to delete first
    assert recreate.returncode == 2
    one_line_error(recreate, "4 partitions", "8 partition queues")
    assert adopt.returncode == 2
    one_line_error(adopt, "4 partitions", "8 partition queues", "etcdctl del")
    assert registry.read_spec(stale.name) == stale


def test_describe_and_status_show_the_queues_beyond_the_spec(partq: Run, stale: StreamSpec) -> None:
    # When the stream is described and its status shown
    text = partq("stream", "describe", stale.name)
    as_json = partq("stream", "describe", stale.name, "--json")
    status = partq("status", stale.name)
    status_json = partq("status", stale.name, "--json")
    # Then each names every queue beyond the 4 partitions, with its messages
    for result in (text, as_json, status, status_json):
        assert result.returncode == 0, result.stderr
    for p in range(4, 8):
        line = f"queue partq.{stale.name}.p{p:05d} exists beyond the stream's 4 partitions: 2"
        assert line in text.stdout, text.stdout
        assert line in status.stdout, status.stdout
    expected = [
        {"partition": p, "queue": f"partq.{stale.name}.p{p:05d}", "messages": 2, "consumers": 0}
        for p in range(4, 8)
    ]
    assert json.loads(as_json.stdout)["beyond_spec"] == expected
    assert json.loads(status_json.stdout)["beyond_spec"] == expected
