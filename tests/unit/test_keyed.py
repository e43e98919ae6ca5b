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

from consumers.keyed import KeyedWorker
from consumers.message import Message
from consumers.port import END, Delivery
from consumers.runners import EventLoop, HandlerPool
from tests.polling import wait_until
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


def _worker(handler: Any, pool: HandlerPool, broker: Broker, dead: DeadLetters) -> KeyedWorker:
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


def test_a_stop_waits_for_messages_in_handlers_and_gives_back_the_waiting_ones() -> None:
    gate = threading.Event()

    def handler(message: Message) -> None:
        gate.wait(5)

    pool = HandlerPool(4)
    broker, dead, channel = Broker(), DeadLetters(), Channel()
    worker = _worker(handler, pool, broker, dead)
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
