"""``partq stream resize``'s operator side on real etcd and RabbitMQ (docs/resize.md).

The consumers that handle fences and record them are not used here: the test reads the
old queues itself and writes the drained keys (``partq.kernel.keys.drained``) as a consumer
would. What is checked: the bindings of each epoch, a fence at the tail of every old
queue's old-layout messages, the spec's count and epoch, no queue deleted while it holds a
message, a resize resumed after it was stopped between any two steps (and after a kill of
the command), and the refusals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from partq.coordinator.leader import resize
from partq.coordinator.leader.resize import Phase, State
from partq.coordinator.leader.resizer import Resizer, ResizeTimeout, read_record
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops import admin
from partq.coordinator.store import codec
from partq.producer.contract import (
    CONTROL_FENCE,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_SEAL,
    QueueType,
    StreamSpec,
    fence_routing_key,
    queue_name,
    seal_digest,
)
from partq.producer.layout import Layout
from partq.producer.queue_probes import check_partition_queues, queue_stats
from partq.producer.registry import Registry
from partq.producer.topology import delete_stream

from partq.kernel import keys
from partq.kernel.local import LocalEtcd
from tests.integration.test_coordinator import Members
from tests.polling import eventually, wait_until

pytestmark = [pytest.mark.integration]

PARTQ = str(Path(sys.executable).with_name("partq"))
OLD = 2  # old-layout messages put in each old queue before the resize
SEAL = "5e" * 16  # the seal of every fence the tests' resizes publish
Run = Callable[..., subprocess.CompletedProcess[str]]
Message = tuple[str, dict[str, Any], bytes]  # routing key, headers, body


class Stopped(Exception):
    """Raised by the ``written`` hook: the command stopped right after writing a record."""


@pytest.fixture
def made(
    registry: Registry, rabbitmq: str, stream_name: str
) -> Iterator[Callable[..., StreamSpec]]:
    """``made(P, queue_type)``: the stream created with P partitions and ``OLD`` messages in
    each queue under epoch 0; every queue it ever had is deleted afterwards."""
    specs: list[StreamSpec] = []

    def make(partitions: int, queue_type: QueueType = "quorum") -> StreamSpec:
        spec = StreamSpec(stream_name, partitions, queue_type, on_failure="park")
        admin.create_stream(registry, rabbitmq, spec)
        specs.append(spec)
        with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
            channel = connection.channel()
            channel.confirm_delivery()
            for p in range(partitions):
                for i in range(OLD):
                    channel.basic_publish(spec.exchange, str(p), f"old-{p}-{i}".encode(),
                                          mandatory=True)  # fmt: skip
        return spec

    yield make
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        for spec in specs:
            delete_stream(connection, StreamSpec(spec.name, 32, spec.queue_type))
    registry.delete(stream_name)


@pytest.fixture
def partq(etcd_server: LocalEtcd, rabbitmq: str) -> Callable[..., subprocess.Popen[str]]:
    """Start ``partq ARGS`` against the test's etcd and RabbitMQ (a process to wait on)."""

    def start(*args: str) -> subprocess.Popen[str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
        environ["PARTQ_ETCD_ENDPOINTS"] = etcd_server.endpoint
        environ["PARTQ_AMQP_URL"] = rabbitmq
        return subprocess.Popen(
            [PARTQ, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
        )

    return start


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=90)
    return process.returncode, out, err


def read_all(connection: pika.BlockingConnection, queue: str) -> list[Message]:
    """Everything in ``queue`` (as many as it counts now), in order, consumed (a quorum
    queue with single active consumer refuses ``basic.get``)."""
    channel = connection.channel()
    count = channel.queue_declare(queue, passive=True).method.message_count
    channel.basic_qos(prefetch_count=200)
    found: list[Message] = []
    for method, properties, body in channel.consume(queue, inactivity_timeout=5):
        if method is None:
            break
        found.append((method.routing_key, dict(properties.headers or {}), body))
        channel.basic_ack(method.delivery_tag)
        if len(found) >= count:
            break
    channel.cancel()
    channel.close()
    return found


def routes(connection: pika.BlockingConnection, spec: StreamSpec, routing_key: str) -> bool:
    """Whether a publish on ``routing_key`` reaches a queue (the broker returns it if not);
    what reached one is read back by the caller."""
    channel = connection.channel()
    channel.confirm_delivery()
    try:
        channel.basic_publish(spec.exchange, routing_key, b"probe", mandatory=True)
    except pika.exceptions.UnroutableError:
        return False
    finally:
        channel.close()
    return True


def depths(
    connection: pika.BlockingConnection, spec: StreamSpec, partitions: int
) -> list[int | None]:
    """The ready messages of queues ``0 … partitions-1`` of ``spec``'s stream (None: gone)."""
    every = StreamSpec(spec.name, partitions, spec.queue_type)
    return [q.messages for q in queue_stats(connection, every)]


def resized(
    made: Callable[..., StreamSpec], registry: Registry, rabbitmq: str, sizes: tuple[int, int],
    queue_type: QueueType,
) -> tuple[StreamSpec, Resizer]:  # fmt: skip
    """A stream of ``sizes[0]`` partitions, messages in each queue, resized to ``sizes[1]``
    up to the switch: its first spec, and the resizer (to go on with)."""
    spec = made(sizes[0], queue_type)
    resizer = Resizer(registry, rabbitmq, spec.name, interval=0.05, seal=lambda: SEAL)
    resizer.start(sizes[1])
    assert resizer.run(Phase.SWITCHED, 60).phase is Phase.SWITCHED
    return spec, resizer


def record_drained(
    registry: Registry, stream: str, epoch: int, partitions: range, seal: str = SEAL
) -> None:
    """Each of ``partitions``' drained key, as a consumer that handled its fence writes it
    (with the fence's seal: ``resized()``'s resizer seals every fence with :data:`SEAL`)."""
    for p in partitions:
        registry.client.put(keys.drained(stream, epoch, p), codec.encode_drained("a", seal))


def assert_fenced(found: list[Message], partition: int, epoch: int) -> None:
    """The old-layout messages of ``partition``, then exactly one fence of ``epoch``."""
    assert [body for _rk, _h, body in found[:OLD]] == [
        f"old-{partition}-{i}".encode() for i in range(OLD)
    ]
    routing_key, headers, _body = found[OLD]
    assert routing_key == fence_routing_key(epoch, partition)
    assert headers[HEADER_CONTROL] == CONTROL_FENCE and headers[HEADER_EPOCH] == epoch
    assert not any(h.get(HEADER_CONTROL) for _rk, h, _b in found[OLD + 1 :])


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_grow_6_to_12_fences_every_old_queue_and_binds_the_next_epoch(
    made: Callable[..., StreamSpec], registry: Registry, rabbitmq: str, queue_type: QueueType
) -> None:
    # Given an idle stream of 6 partitions with messages in every queue, resized to 12
    # (returning once switched)
    spec, resizer = resized(made, registry, rabbitmq, (6, 12), queue_type)
    state = resizer.state
    # Then the spec holds 12 partitions in epoch 1, and the record says switched
    assert registry.read_spec(spec.name) == StreamSpec(
        spec.name, 12, queue_type, on_failure="park", epoch=1
    )
    assert read_record(registry, spec.name)[0] == state
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        # and the old epoch's routing keys (and the fences') route nowhere; the new ones do
        assert not any(routes(connection, spec, str(p)) for p in range(6))
        assert not any(routes(connection, spec, fence_routing_key(0, p)) for p in range(6))
        assert all(routes(connection, spec, Layout(12, 1).routing_key(q)) for q in range(12))
        # and every old queue holds its old messages, then its fence, then the new one
        for p in range(6):
            found = read_all(connection, queue_name(spec.name, p))
            assert_fenced(found, p, 0)
            assert [(rk, b) for rk, _h, b in found[OLD + 1 :]] == [(f"1.{p}", b"probe")]
        for q in range(6, 12):  # the added queues: only new-layout messages
            assert [(rk, b) for rk, _h, b in read_all(connection, queue_name(spec.name, q))] == [
                (f"1.{q}", b"probe")
            ]
    # When --wait is asked before the consumers handled the fences / Then it times out,
    # still switched, naming the partitions that did not drain
    record_drained(registry, spec.name, 0, range(4))
    with pytest.raises(ResizeTimeout, match=r"switched .* not drained yet: 4-5"):
        resizer.run(Phase.RETIRED, 0.5)
    # When the last fences are handled / Then the resize retires (a grow deletes nothing)
    record_drained(registry, spec.name, 0, range(4, 6))
    assert resizer.run(Phase.RETIRED, 30).phase is Phase.RETIRED
    # and the witnesses of the count accept the resized stream: creating it again with 12
    # is "unchanged" and binds no old routing key, adopting it keeps its epoch
    resized_spec = registry.read_spec(spec.name)
    again = StreamSpec(spec.name, 12, queue_type, on_failure="park")
    assert not admin.create_stream(registry, rabbitmq, again)
    assert admin.adopt_stream(registry, rabbitmq, spec.name) == (resized_spec, False)
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert not any(routes(connection, spec, str(p)) for p in range(12))
        assert depths(connection, spec, 13) == [0] * 12 + [None]


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_shrink_12_to_8_deletes_the_retired_queues_only_once_empty(
    made: Callable[..., StreamSpec], registry: Registry, rabbitmq: str, queue_type: QueueType
) -> None:
    # Given an idle stream of 12 partitions with messages in every queue, resized to 8
    spec, resizer = resized(made, registry, rabbitmq, (12, 8), queue_type)
    assert registry.read_spec(spec.name).layout == Layout(8, 1)
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert all(routes(connection, spec, Layout(8, 1).routing_key(q)) for q in range(8))
        assert not routes(connection, spec, "1.8") and not routes(connection, spec, "11")
        for q in range(8):  # kept queues: old messages, the fence, then the new layout's
            found = read_all(connection, queue_name(spec.name, q))
            assert_fenced(found, q, 0)
            assert [rk for rk, _h, _b in found[OLD + 1 :]] == [f"1.{q}"]
    # and a producer starting now passes the witness check (the queues beyond 8 drain)
    check_partition_queues(rabbitmq, registry.read_spec(spec.name))
    # When every fence is recorded handled but the retired queues were never read
    record_drained(registry, spec.name, 0, range(12))
    with pytest.raises(ResizeTimeout, match=r"drained .* not empty or still consumed: 8-11"):
        resizer.run(Phase.RETIRED, 1.0)
    # Then none of them is deleted: each still holds its old messages and its fence
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert depths(connection, spec, 12)[8:] == [OLD + 1] * 4
        # When their consumers have read them (old messages, then the fence, last)
        for p in range(8, 12):
            assert_fenced(read_all(connection, queue_name(spec.name, p)), p, 0)
    # Then the resize retires and deletes them; the kept queues stay
    state = resizer.run(Phase.RETIRED, 30)
    assert state.phase is Phase.RETIRED and state.deleted == frozenset(range(8, 12))
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert depths(connection, spec, 12) == [0] * 8 + [None] * 4
    # and a producer's witness check (no queue beyond the spec) passes again, and describe shows no
    # resize running
    description = admin.describe(registry, rabbitmq, spec.name)
    assert description.beyond == [] and description.resize == state
    # And the next resize's record takes this one's drained keys with it
    assert len(list(registry.client.get_prefix(keys.drained_all(spec.name)))) == 12
    Resizer(registry, rabbitmq, spec.name).start(16)
    assert list(registry.client.get_prefix(keys.drained_all(spec.name))) == []


def test_deleting_a_stream_during_a_shrink_deletes_the_queues_of_both_layouts(
    made: Callable[..., StreamSpec], registry: Registry, rabbitmq: str
) -> None:
    # Given a shrink 12 -> 8, switched: the spec has 8 partitions, RabbitMQ 12 queues
    spec, _resizer = resized(made, registry, rabbitmq, (12, 8), "quorum")
    # When the stream is deleted / Then every one of the 12 is gone
    admin.delete(registry, rabbitmq, spec.name)
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert depths(connection, spec, 12) == [None] * 12


@pytest.mark.parametrize(
    ("stop_after", "switched"),
    [(phase, False) for phase in list(Phase)[:5]] + [(Phase.BOUND, True)],
)
def test_a_resize_stopped_after_any_step_is_continued_by_running_it_again(
    made: Callable[..., StreamSpec],
    registry: Registry,
    rabbitmq: str,
    stop_after: Phase,
    switched: bool,
) -> None:
    # Given a resize 6 -> 12 that stops right after writing the record of ``stop_after``,
    # before carrying out its actions (as a kill there would); with ``switched``, after
    # its switch of the spec took but before that was recorded
    spec = made(6)

    def stop(state: State) -> None:
        if state.phase is stop_after:
            raise Stopped(state.phase.value)

    first = Resizer(registry, rabbitmq, spec.name, written=stop)
    with pytest.raises(Stopped):
        first.start(12)
        first.run(Phase.SWITCHED, 60)
    assert read_record(registry, spec.name)[0].phase is stop_after  # type: ignore[union-attr]
    if switched:
        first._switch(6, 0, 12, 1)
    # When it is run again with the same count
    again = Resizer(registry, rabbitmq, spec.name)
    again.start(12)
    assert again.resumed
    # Then it continues to the switch, and the broker is as after an uninterrupted resize
    assert again.run(Phase.SWITCHED, 60).phase is Phase.SWITCHED
    assert registry.read_spec(spec.name).layout == Layout(12, 1)
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        assert not any(routes(connection, spec, str(p)) for p in range(6))
        assert all(routes(connection, spec, Layout(12, 1).routing_key(q)) for q in range(12))
        for p in range(6):
            found = read_all(connection, queue_name(spec.name, p))
            assert_fenced(found, p, 0)  # one fence: stopped before any was published twice


def test_the_command_killed_mid_way_is_finished_by_the_same_command(
    made: Callable[..., StreamSpec],
    registry: Registry,
    rabbitmq: str,
    partq: Callable[..., subprocess.Popen[str]],
) -> None:
    # Given `partq stream resize` killed (SIGKILL) as soon as its record exists
    spec = made(12, "classic")
    process = partq("stream", "resize", spec.name, "--partitions", "8")
    wait_until(lambda: read_record(registry, spec.name)[0] is not None, 30, 0.005,
               what="the resize record")  # fmt: skip
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    killed_in = read_record(registry, spec.name)[0]
    assert killed_in is not None
    # When the consumers' part is played (each old queue read; its fence recorded) while
    # the same command runs again with --wait
    again = partq("stream", "resize", spec.name, "--partitions", "8", "--wait", "--timeout", "60")
    wait_until(lambda: registry.read_spec(spec.name).epoch == 1, 60, what="the switch of the rerun")
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        for p in range(12):
            found = wait_until(lambda p=p: read_all(connection, queue_name(spec.name, p)), 30)
            assert_fenced(found, p, 0)
            seal = found[OLD][1][HEADER_SEAL]  # what the consumer of the fence learns
            record_drained(registry, spec.name, 0, range(p, p + 1), seal)
    # Then it says it continued, and returns once the old layout is retired
    code, out, err = finished(again)
    assert code == 0, err
    assert "continuing the resize 12 -> 8" in out
    assert "the old layout is drained and retired" in out
    assert read_record(registry, spec.name)[0].phase is Phase.RETIRED  # type: ignore[union-attr]


def test_refusals_are_one_line_and_describe_shows_a_running_resize(
    made: Callable[..., StreamSpec], partq: Callable[..., subprocess.Popen[str]]
) -> None:
    spec = made(6)

    def refused(*args: str) -> str:
        code, out, err = finished(partq("stream", "resize", spec.name, *args))
        assert code == 2 and out == "", (code, out, err)
        assert len(err.strip().splitlines()) == 1, err
        return err

    assert "already has 6 partitions" in refused("--partitions", "6")
    assert "out of range: give 1 to 65536" in refused("--partitions", "0")
    assert "out of range" in refused("--partitions", "65537")
    # Given a resize to 12 that is switched, its old partitions not drained
    code, out, err = finished(partq("stream", "resize", spec.name, "--partitions", "12"))
    assert code == 0, err
    assert f"partq status {spec.name}" in out and "--partitions 12 --wait" in out
    # Then a resize to another count is refused, naming the one running
    assert "a resize to 12 partitions is already running (switched)" in refused("-p", "24")
    # and create (which would bind a layout) too
    code, _out, err = finished(partq("stream", "create", spec.name, "--partitions", "12"))
    assert code == 2 and "is being resized to 12 partitions (switched)" in err
    # and describe shows the resize: phase, old partitions draining, gates closed
    code, out, err = finished(partq("stream", "describe", spec.name))
    assert code == 0, err
    assert "12 partitions (epoch 1)" in out
    assert "resize 6 -> 12 partitions (epoch 1): switched" in out
    assert "old partitions still draining (fence not handled): 0-5" in out
    assert "gates closed (new partition on old ones): 6 on 0; 7 on 1" in out
    # and so does status, as text and as JSON
    code, out, err = finished(partq("status", spec.name))
    assert code == 0 and "resize 6 -> 12 partitions (epoch 1): switched" in out, err
    code, out, err = finished(partq("status", spec.name, "--json"))
    assert code == 0, err
    shown = json.loads(out)["resize"]
    assert (shown["phase"], shown["draining"], shown["waiting"]["11"]) == (
        "switched",
        [*range(6)],
        [5],
    )
    # and the same count continues it (here: nothing left to do before the fences)
    code, out, err = finished(partq("stream", "resize", spec.name, "-p", "12", "--timeout", "5"))
    assert code == 0 and "continuing the resize 6 -> 12" in out, err


def test_the_coordinator_serves_a_shrink_s_old_partitions_until_they_drain(
    registry: Registry, stream_name: str
) -> None:
    # Given a stream of 12 partitions, its coordinator, and members a and b sharing them
    registry.create(StreamSpec(stream_name, 12))
    members = Members(registry, stream_name)
    coordinator = StreamCoordinator(registry, stream_name, CoordinatorConfig(ttl=2, settle=0.1))
    coordinator.start()
    try:
        assert coordinator.leading.wait(10)
        members.join("a")
        members.join("b")
        owned = lambda: sorted(members.assignment())  # noqa: E731
        eventually("all 12 assigned", lambda: owned() == list(range(12)), 15)
        # When a resize to 8 switches (record, then spec, as `partq stream resize` writes them)
        state, _ = resize.begin(Layout(12), 8, running=None)
        state = replace(state, seals=frozenset((p, seal_digest(SEAL)) for p in range(12)))
        state = replace(state, phase=Phase.SWITCHED, fenced=frozenset(range(12)))
        registry.client.put(keys.resize(stream_name), resize.encode(state))
        registry.client.put(keys.spec(stream_name), StreamSpec(stream_name, 8, epoch=1).to_json())
        leads = lambda: coordinator.leading.is_set() and coordinator.spec.epoch == 1  # type: ignore[union-attr]  # noqa: E731
        eventually("a coordinator of the new spec", leads, 15)
        # Then the retired partitions 8-11 are served while their fences are not handled:
        # when b leaves, a is given all 12
        members.leave("b")
        only_a = {p: "a" for p in range(12)}
        eventually("a owns the 12", lambda: members.assignment() == only_a, 15)
        # When 10 and 11 drain / Then they are given up; 8 and 9 (a prefix) are kept
        drained = replace(state, drained=frozenset({10, 11}))
        registry.client.put(keys.resize(stream_name), resize.encode(drained))
        eventually("10 and 11 unassigned", lambda: owned() == list(range(10)), 15)
        # When 8 and 9's consumer records their fences handled, and the record is not told
        # (the command returned without --wait) / Then they are given up too, by those keys
        for p in (8, 9):
            registry.client.put(keys.drained(stream_name, 0, p), codec.encode_drained("a", SEAL))
        eventually("8 and 9 unassigned", lambda: owned() == list(range(8)), 15)
        # When every old partition drained / Then the stream's 8 partitions alone are assigned
        drained = replace(state, phase=Phase.DRAINED, drained=frozenset(range(12)))
        registry.client.put(keys.resize(stream_name), resize.encode(drained))
        eventually("8 partitions assigned", lambda: owned() == list(range(8)), 15)
        # When a resize to 16 switches / Then the added partitions get owners
        grow, _ = resize.begin(Layout(8, 1), 16, running=replace(drained, phase=Phase.RETIRED))
        registry.client.put(
            keys.resize(stream_name), resize.encode(replace(grow, phase=Phase.SWITCHED))
        )
        registry.client.put(keys.spec(stream_name), StreamSpec(stream_name, 16, epoch=2).to_json())
        eventually("16 partitions assigned", lambda: owned() == list(range(16)), 15)
        assert set(members.assignment().values()) == {"a"}
    finally:
        coordinator.stop()
        coordinator.join(10)
        members.close()
        registry.delete(stream_name)
