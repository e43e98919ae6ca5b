"""The keyed worker (``--concurrency`` above 1) with fakes around it: keys overlap, a key
never does, the partition finishes only after its last message, async handlers too."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pika
import pytest
from partq.consumers.broker.port import END, Delivery
from partq.consumers.handling.keyed import KeyedWorker, concurrency_report
from partq.consumers.handling.message import Message
from partq.consumers.handling.runners import EventLoop, HandlerPool
from partq.producer.contract import key_id

from tests.polling import wait_until
from tests.unit.test_parking import FakeParking
from tests.unit.test_worker import PARTITION, SPEC, Broker, Channel, DeadLetters, Session


class Spans:
    """Start and end of every handler call, per key, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, str, float, float]] = []  # key, message id, start, end

    def add(self, key: str, message_id: str, start: float) -> None:
        with self.lock:
            self.spans.append((key, message_id, start, time.monotonic()))

    def same_key_overlaps(self) -> list[tuple[str, str]]:
        found = []
        spans = sorted(self.spans, key=lambda s: s[2])
        for i, (key, mid, _start, end) in enumerate(spans):
            for key2, mid2, start2, _end2 in spans[i + 1 :]:
                if key2 == key and start2 < end:
                    found.append((mid, mid2))
        return found

    def most_at_once(self) -> int:
        edges = sorted([(s[2], 1) for s in self.spans] + [(s[3], -1) for s in self.spans])
        now = best = 0
        for _t, step in edges:
            now += step
            best = max(best, now)
        return best

    def order(self, key: str) -> list[str]:
        return [mid for k, mid, _s, _e in sorted(self.spans, key=lambda s: s[2]) if k == key]


def _worker(
    handler: Any, pool: HandlerPool, broker: Broker, dead: DeadLetters, parking: Any = None,
    **options: Any,
) -> KeyedWorker:  # fmt: skip
    worker = KeyedWorker(
        pool=pool,
        spec=SPEC,
        partition=PARTITION,
        member=f"m-{uuid.uuid4().hex[:8]}",
        handler=handler,
        broker=broker,
        session=Session(),
        dead_letters=dead,
        max_attempts=3,
        retry_backoff=0.001,
        previous=None,
        freed_at=None,
        loop=EventLoop(),
        parking=parking,
        **options,
    )
    worker.start()
    return worker


def _deliver(worker: KeyedWorker, channel: Channel, tag: int, key: str) -> None:
    headers = {"partq-key": key, "partq-partition": PARTITION, "partq-published-ms": 1}
    props = pika.BasicProperties(message_id=f"{key}-{tag}", headers=headers)
    worker.inbox.put(Delivery(PARTITION, channel, tag, False, props, b"x"))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_keys_overlap_a_key_never_does_and_everything_is_acked(kind: str) -> None:
    # Given 8 pool threads and a handler that takes 20 ms
    spans = Spans()

    def sync_handler(message: Message) -> None:
        start = time.monotonic()
        time.sleep(0.02)
        spans.add(str(message.key), str(message.message_id), start)

    async def async_handler(message: Message) -> None:
        start = time.monotonic()
        await asyncio.sleep(0.02)
        spans.add(str(message.key), str(message.message_id), start)

    pool = HandlerPool(8)
    broker, dead, channel = Broker(), DeadLetters(), Channel()
    worker = _worker(sync_handler if kind == "sync" else async_handler, pool, broker, dead)
    # When 60 messages of 6 keys arrive
    keys = [f"k{i % 6}" for i in range(60)]
    for tag, key in enumerate(keys, start=1):
        _deliver(worker, channel, tag, key)
    worker.inbox.put((END, channel))
    # Then the partition finishes after every message was handled and acked
    assert broker.finished.wait(10)
    assert sorted(broker.acked) == list(range(1, 61))
    assert spans.same_key_overlaps() == []
    for key in sorted(set(keys)):  # each key in arrival order
        tags = [tag for tag, k in enumerate(keys, start=1) if k == key]
        assert spans.order(key) == [f"{key}-{tag}" for tag in tags]
    assert 2 <= spans.most_at_once() <= 8  # concurrent, within the pool's bound
    worker.join(5)
    pool.close()


def test_a_failing_key_is_retried_then_dead_lettered_while_others_go_on() -> None:
    async def handler(message: Message) -> None:
        await asyncio.sleep(0.001)
        if message.key == "bad":
            raise RuntimeError("no")

    pool = HandlerPool(4)
    broker, dead, channel = Broker(), DeadLetters(), Channel()
    worker = _worker(handler, pool, broker, dead)
    for tag, key in enumerate(["bad", "good", "good", "bad"], start=1):
        _deliver(worker, channel, tag, key)
    worker.inbox.put((END, channel))
    assert broker.finished.wait(10)
    assert sorted(broker.acked) == [1, 2, 3, 4]
    assert sorted((mid, attempts) for mid, _e, attempts in dead.published) == [
        ("bad-1", 3),
        ("bad-4", 3),
    ]
    pool.close()


def test_a_key_failing_inside_a_coroutine_is_parked_in_order_while_others_go_on() -> None:
    # Given a parking stream and an async handler that raises, after an await, for "bad"
    parking = FakeParking()
    handled: list[str] = []

    async def handler(message: Message) -> None:
        await asyncio.sleep(0.005)
        if message.key == "bad":
            raise RuntimeError(f"failed {message.message_id}")
        handled.append(str(message.message_id))

    pool = HandlerPool(4)
    broker, dead, channel = Broker(), DeadLetters(), Channel()
    worker = _worker(handler, pool, broker, dead, parking)
    # When two messages of "bad" and three of "good" arrive
    for tag, key in enumerate(["bad", "good", "bad", "good", "good"], start=1):
        _deliver(worker, channel, tag, key)
    worker.inbox.put((END, channel))
    # Then "bad" is parked (its first after 3 attempts, its second behind it, unhandled),
    # "good" flows, nothing is dead-lettered, and each message is acked once
    assert broker.finished.wait(10)
    assert parking.parked.get(key_id("bad")) is not None
    assert [d.properties.message_id for d in parking.queues[key_id("bad")]] == ["bad-1", "bad-3"]
    assert handled == ["good-2", "good-4", "good-5"]
    assert dead.published == []
    assert sorted(broker.acked) == [1, 2, 3, 4, 5]
    worker.join(5)
    pool.close()


def _gated() -> tuple[threading.Event, HandlerPool, Broker, Channel, KeyedWorker]:
    """A keyed worker on 4 pool threads whose handler holds every message until the gate
    opens (10 s at most)."""
    gate = threading.Event()

    def handler(message: Message) -> None:
        gate.wait(10)

    pool = HandlerPool(4)
    broker, channel = Broker(), Channel()
    return gate, pool, broker, channel, _worker(handler, pool, broker, DeadLetters())


def test_a_stop_waits_for_messages_in_handlers_and_gives_back_the_waiting_ones() -> None:
    gate, pool, broker, channel, worker = _gated()
    for tag in (1, 2):
        _deliver(worker, channel, tag, "k")  # the second waits behind the first
    wait_until(lambda: worker.busy, 5, 0.01, "the first message in its handler")
    worker.stop()
    worker.join(0.2)
    assert worker.is_alive()  # its first message is still in the handler
    gate.set()
    worker.join(5)
    assert not worker.is_alive()
    assert broker.closed == [PARTITION]  # the channel closed: the broker requeues the rest
    pool.close()


def test_the_report_shows_messages_in_handlers_and_the_key_waiting_longest() -> None:
    # Given a handler that holds every message until a gate opens
    gate, pool, broker, channel, worker = _gated()
    # When three messages of "hot" and one of "cold" arrive
    for tag, key in enumerate(["hot", "cold", "hot", "hot"], start=1):
        _deliver(worker, channel, tag, key)
    # Then, once the dispatcher has looked (about once a second), the report shows two in
    # handlers and "hot" waiting behind its own first message
    wait_until(lambda: worker.longest_wait > 0, 5, 0.02, "the dispatcher's look")
    report = concurrency_report(4, {PARTITION: worker})
    assert (report.setting, report.in_flight) == (4, {PARTITION: 2})
    assert report.waiting_key == "'hot'" and report.waiting_seconds > 0
    gate.set()
    worker.inbox.put((END, channel))
    assert broker.finished.wait(10)
    assert concurrency_report(4, {PARTITION: worker}).in_flight == {PARTITION: 0}
    pool.close()


def test_an_async_message_is_acked_only_once_its_coroutine_finished() -> None:
    # Given an async handler that waits for a gate, beside a key whose coroutine ends at once
    gate = asyncio.Event()  # bound to the worker's loop on first use

    async def handler(message: Message) -> None:
        if message.key == "slow":
            await gate.wait()

    pool = HandlerPool(4)
    broker, channel = Broker(), Channel()
    worker = _worker(handler, pool, broker, DeadLetters())
    # When one message of each key arrives
    _deliver(worker, channel, 1, "slow")
    _deliver(worker, channel, 2, "fast")
    # Then only the finished one is acked while the other's coroutine waits
    wait_until(lambda: broker.acked == [2], 5, 0.01, "the fast message acked")
    time.sleep(0.2)
    assert broker.acked == [2]
    worker.loop.wait(_set(gate))
    worker.inbox.put((END, channel))
    assert broker.finished.wait(10)
    assert sorted(broker.acked) == [1, 2]
    pool.close()


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_the_pool_starts_a_partitions_first_message_ahead_of_what_is_queued() -> None:
    # Given a pool of one thread, busy, with two messages of other partitions queued
    pool = HandlerPool(1)
    gate, busy, order = threading.Event(), threading.Event(), []
    pool.submit(lambda: (busy.set(), gate.wait(10)))
    assert busy.wait(10)
    pool.submit(lambda: order.append("queued 1"))
    pool.submit(lambda: order.append("queued 2"))
    # When a partition just handed over submits its first message
    pool.submit(lambda: order.append("first"), first=True)
    gate.set()
    # Then the next free thread starts it before the queued ones, which keep their order
    wait_until(lambda: len(order) == 3, 10, 0.01, "all three run")
    assert order == ["first", "queued 1", "queued 2"]
    pool.close()
