"""What the resize protocol (docs/resize.md) needs of RabbitMQ, checked on the real broker.

The protocol is not wired yet; these pin the broker behaviour it is built on, so that a
RabbitMQ that behaves otherwise fails here first:

- a publish whose epoch's binding was cut is returned (``mandatory``), and the next epoch's
  routing key (``"E.q"``) reaches the same queue;
- on one channel publishing throughout the cut, the returned messages are exactly a suffix
  of what it published, and none of them is in the queue behind a fence published after
  the cut (on one node);
- the actions are idempotent: unbinding twice, deleting a queue that is gone; and
  ``if-empty`` refuses to delete a queue with a message in it;
- a drain's fillers reach every declared queue through the dead-letter exchange, and a
  retired queue the cut unbound returns them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
from partq.coordinator.leader import resize
from partq.coordinator.leader.resizer import Resizer
from partq.producer.contract import StreamSpec
from partq.producer.layout import Layout, Resize
from partq.producer.registry import Registry
from partq.producer.topology import declare_stream, delete_stream, unbind_fillers

from tests.polling import wait_until

pytestmark = [pytest.mark.integration]

FENCE = b"fence"
MOST = 200_000  # the publisher's bound, far above what a round sends


@pytest.fixture(params=["quorum", "classic"])
def spec(request: pytest.FixtureRequest, rabbitmq: str, stream_name: str) -> Iterator[StreamSpec]:
    """A stream of 2 partitions, declared as partq declares it, deleted afterwards."""
    made = StreamSpec(stream_name, 2, request.param)
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as setup:
        declare_stream(setup, made)
    yield made
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as teardown:
        delete_stream(teardown, made)


@pytest.fixture
def connection(spec: StreamSpec, rabbitmq: str) -> Iterator[pika.BlockingConnection]:
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        yield connection


def bind(channel: pika.adapters.blocking_connection.BlockingChannel, spec: StreamSpec,
         layout: Layout) -> None:  # fmt: skip
    for p in range(layout.partitions):
        channel.queue_bind(spec.queue(p), spec.exchange, layout.routing_key(p))


def unbind(channel: pika.adapters.blocking_connection.BlockingChannel, spec: StreamSpec,
           layout: Layout) -> None:  # fmt: skip
    for p in range(layout.partitions):
        channel.queue_unbind(spec.queue(p), spec.exchange, layout.routing_key(p))


def drain(channel: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> list[bytes]:
    """Everything in ``queue``, in order (consumed: a quorum queue with single active
    consumer refuses ``basic.get``)."""
    bodies = []
    channel.basic_qos(prefetch_count=500)
    for method, _props, body in channel.consume(queue, inactivity_timeout=3):
        if method is None or len(bodies) > MOST:
            break
        bodies.append(body)
        channel.basic_ack(method.delivery_tag)
    channel.cancel()
    return bodies


def test_a_cut_epoch_is_returned_and_the_next_epoch_routes(
    spec: StreamSpec, connection: pika.BlockingConnection
) -> None:
    # Given epoch 1 bound beside epoch 0, then epoch 0 cut
    admin = connection.channel()
    bind(admin, spec, Layout(2, 1))
    unbind(admin, spec, Layout(2, 0))
    producer = connection.channel()
    producer.confirm_delivery()
    # When a producer publishes under epoch 0 / Then the broker returns it
    with pytest.raises(pika.exceptions.UnroutableError):
        producer.basic_publish(spec.exchange, Layout(2).routing_key(1), b"old", mandatory=True)
    # and under epoch 1 it reaches the partition's queue
    producer.basic_publish(spec.exchange, Layout(2, 1).routing_key(1), b"new", mandatory=True)
    assert drain(admin, spec.queue(1)) == [b"new"]


def test_the_actions_can_be_done_twice_and_a_queue_with_a_message_is_kept(
    spec: StreamSpec, connection: pika.BlockingConnection, rabbitmq: str
) -> None:
    admin = connection.channel()
    # Given an unbinding done twice (a leader that died before it recorded the first)
    unbind(admin, spec, Layout(2, 0))
    unbind(admin, spec, Layout(2, 0))
    # and a retired queue that still holds a message
    admin.basic_publish("", spec.queue(1), b"kept")
    # When it is deleted "if empty" / Then a classic queue refuses; a quorum queue does not
    # support the flag at all (RabbitMQ closes the connection): the resize's shell must count
    # the messages itself, and may delete only a queue that no binding can fill
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as other:
        if spec.queue_type == "classic":
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                other.channel().queue_delete(spec.queue(1), if_empty=True)
            assert refused.value.reply_code == 406
        else:
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as refused:
                other.channel().queue_delete(spec.queue(1), if_empty=True)
            assert refused.value.reply_code == 540
            assert "if-empty flag set are not supported by quorum queues" in str(refused.value)
    held = connection.channel().queue_declare(spec.queue(1), passive=True)
    assert held.method.message_count == 1
    assert drain(connection.channel(), spec.queue(1)) == [b"kept"]
    # and an empty queue goes (delete-ok counts what it deleted: none), and deleting it
    # again is no error
    again = connection.channel()
    assert again.queue_declare(spec.queue(1), passive=True).method.message_count == 0
    assert again.queue_delete(spec.queue(1)).method.message_count == 0
    assert again.queue_delete(spec.queue(1)).method.message_count == 0


def test_every_queue_takes_fillers_until_a_shrink_unbinds_it(
    spec: StreamSpec, connection: pika.BlockingConnection
) -> None:
    # Given a stream as declared (partq.consumers.broker.fillers: a drain fills its window this way)
    producer = connection.channel()
    producer.confirm_delivery()
    # When a filler is published to each queue through the dead-letter exchange
    for p in range(2):
        queue = spec.queue(p)
        producer.basic_publish(spec.dead_letter_exchange, queue, b"", mandatory=True)
    # Then each queue holds it
    assert [drain(connection.channel(), spec.queue(p)) for p in range(2)] == [[b""], [b""]]
    # and once a shrink to 1 partition cut its retired queue's binding (twice: idempotent),
    # a filler for it is returned, so nothing can refill it before its delete
    unbind_fillers(connection, spec, Resize(Layout(2), Layout(1, 1)).retired)
    unbind_fillers(connection, spec, range(1, 2))
    with pytest.raises(pika.exceptions.UnroutableError):
        producer.basic_publish(spec.dead_letter_exchange, spec.queue(1), b"", mandatory=True)
    producer.basic_publish(spec.dead_letter_exchange, spec.queue(0), b"", mandatory=True)


class Publisher(threading.Thread):
    """Publishes 0, 1, 2, … under epoch 0 to partition 0, ``mandatory``, without waiting
    for confirms, on its own connection; notes what the broker returns."""

    def __init__(self, url: str, spec: StreamSpec) -> None:
        super().__init__(daemon=True)
        self.url, self.spec = url, spec
        self.stop = threading.Event()
        self.sent = 0
        self.returned: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # shown by the test, not lost in the thread
            self.error = e

    def _run(self) -> None:
        with pika.BlockingConnection(pika.URLParameters(self.url)) as connection:
            channel = connection.channel()
            channel.add_on_return_callback(
                lambda _ch, _m, _p, body: self.returned.append(int(body))
            )
            routing_key = Layout(2).routing_key(0)
            while not self.stop.is_set() and self.sent < MOST:
                channel.basic_publish(
                    self.spec.exchange, routing_key, str(self.sent).encode(), mandatory=True
                )
                self.sent += 1
                if self.sent % 100 == 0:
                    connection.process_data_events(time_limit=0)
            # a confirmed publish after the others: the broker answers a channel in order,
            # so every return of an earlier publish has arrived once this is confirmed
            channel.confirm_delivery()
            channel.basic_publish(self.spec.exchange, "no-such-route", b"-1", mandatory=False)
            connection.process_data_events(time_limit=0)  # runs the callbacks of those returns


@pytest.mark.slow
def test_returns_are_a_suffix_and_nothing_lands_behind_the_fence(
    spec: StreamSpec, connection: pika.BlockingConnection, rabbitmq: str
) -> None:
    # Given a producer publishing to partition 0 as fast as it can, under epoch 0
    publisher = Publisher(rabbitmq, spec)
    publisher.start()
    admin = connection.channel()
    admin.confirm_delivery()
    try:
        wait_until(lambda: publisher.sent >= 2_000, 60, what="the publisher under way")
        # When the coordinator cuts epoch 0, then fences partition 0's queue, confirmed
        unbind(admin, spec, Layout(2, 0))
        admin.basic_publish("", spec.queue(0), FENCE, mandatory=True)
        wait_until(lambda: len(publisher.returned) >= 500, 60, what="returns after the cut")
    finally:
        publisher.stop.set()
        publisher.join(60)
    assert publisher.error is None, publisher.error
    assert not publisher.is_alive()
    # Then the queue holds a prefix of what was sent and the fence last, nothing after it
    held = drain(admin, spec.queue(0))
    assert held[-1] == FENCE and FENCE not in held[:-1]
    stored = [int(body) for body in held[:-1]]
    assert stored == list(range(len(stored)))
    # and every other message came back to the producer, in the order it was sent
    assert publisher.returned == list(range(len(stored), publisher.sent))


def test_a_retired_queue_kept_for_a_message_is_logged_once_then_once_deleted(
    spec: StreamSpec,
    connection: pika.BlockingConnection,
    registry: Registry,
    rabbitmq: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a shrink's retired queue holding one message
    queue = spec.queue(1)
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"late")
    resizer = Resizer(registry, rabbitmq, spec.name)
    caplog.set_level(logging.DEBUG, logger="partq")

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and queue in r.message]

    # When the resize tries to delete it, round after round
    for _ in range(5):
        assert resizer._do(connection, spec, "guest", resize.Delete(1)) == resize.NotEmpty(1)
    # Then it warns once, the retries said at debug only
    assert len(said(logging.WARNING)) == 1 and "not empty" in said(logging.WARNING)[0]
    assert len(said(logging.DEBUG)) == 4
    # When the message is gone and it is tried again
    channel.queue_purge(queue)
    assert resizer._do(connection, spec, "guest", resize.Delete(1)) == resize.Deleted(1)
    # Then one line says it is deleted
    assert said(logging.INFO) == [f"{spec.name}: retired queue {queue} is empty now: deleted"]
    assert len(said(logging.WARNING)) == 1
