"""``AsyncProducer``: the Producer's contract from asyncio code, against real etcd and RabbitMQ.

Each test runs its coroutine with ``asyncio.run`` and bounds every wait with a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from partq.producer import (
    AsyncProducer,
    MessageUnroutable,
    ProducerClosed,
    Receipt,
    StreamNotFound,
    UsageError,
    partition_for,
)
from partq.producer.contract import HEADER_CONTROL, QueueType
from partq.producer.registry import Registry

from tests.conftest import Ctl
from tests.integration.test_producer import (
    MakeStream,
    P,
    assert_republished_in_order,
    close_connection,
    connection_pids,
    drain,
    make_stream,
    publish_counts,
    unbound_partition,
)

__all__ = ["make_stream", "publish_counts"]  # fixtures, used by name

pytestmark = pytest.mark.integration

T = TypeVar("T")


def run(coroutine: Awaitable[T], timeout: float = 120.0) -> T:
    """Run a test's coroutine in a fresh event loop, failing rather than hanging."""

    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


@dataclass
class Ticker:
    """A task that asks for a 1 ms sleep over and over and records, per phase, how late each
    wake-up was (wall clock) and how much CPU the loop's thread spent meanwhile.

    The wall-clock lateness includes the time the machine did not run this process at all
    (here: load 4-10 on 2 cores); the thread's CPU time does not, so it shows what the
    event loop itself was busy with. The interpreter's full garbage collections (25-35 ms
    of CPU in this process, whatever triggers them) are counted apart. A call that blocks
    the loop's thread in a wait shows as a phase without a single tick."""

    phase: str = "start"
    ticks: collections.Counter[str] = field(default_factory=collections.Counter)
    max_lag: float = 0.0
    max_cpu: float = 0.0  # without garbage collection
    max_gc: float = 0.0
    gc_cpu: float = 0.0  # the loop thread's CPU in garbage collection, so far
    _gc_started: float = 0.0

    def __str__(self) -> str:
        return (
            f"max lag {self.max_lag:.3f}s, max CPU {self.max_cpu:.3f}s (+ garbage collection "
            f"up to {self.max_gc:.3f}s), ticks {dict(self.ticks)}"
        )

    def on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            self.gc_cpu += time.thread_time() - self._gc_started

    async def run(self) -> None:
        while True:
            asked, cpu, in_gc = time.perf_counter(), time.thread_time(), self.gc_cpu
            await asyncio.sleep(0.001)
            gc_cpu = self.gc_cpu - in_gc
            self.max_lag = max(self.max_lag, time.perf_counter() - asked - 0.001)
            self.max_cpu = max(self.max_cpu, time.thread_time() - cpu - gc_cpu)
            self.max_gc = max(self.max_gc, gc_cpu)
            self.ticks[self.phase] += 1


@asynccontextmanager
async def ticking() -> AsyncIterator[Ticker]:
    """A Ticker running in a task of the current loop (which runs in the main thread)."""
    ticker = Ticker()
    gc.callbacks.append(ticker.on_gc)
    task = asyncio.create_task(ticker.run())
    await asyncio.sleep(0)
    try:
        yield ticker
    finally:
        task.cancel()
        gc.callbacks.remove(ticker.on_gc)


def bodies_by_key(rabbitmq: str, spec: Any) -> dict[str | bytes | None, list[int]]:
    """Drain the stream; each key's sequence numbers (``key:seq`` bodies) in queue order,
    checking each message sits in its key's partition queue."""
    seqs: dict[str | bytes | None, list[int]] = collections.defaultdict(list)
    for d in drain(rabbitmq, spec):
        key, seq = d.body.decode().rsplit(":", 1)
        assert d.key == key and d.queue == spec.queue(partition_for(key, spec.partitions))
        seqs[key].append(int(seq))
    return seqs


# -- publish, send, publish_many: confirmed, and consumed in per-key order ----------------------


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_publish_and_publish_many_confirm_in_per_key_order(
    make_stream: MakeStream, registry: Registry, rabbitmq: str, queue_type: QueueType
) -> None:
    # Given a stream of 8 partitions and 40 keys
    spec = make_stream(P, queue_type)
    keys = [f"user-{i}" for i in range(40)]

    async def main() -> list[Receipt]:
        # And an AsyncProducer that reads the spec from etcd, with a window smaller than a batch
        async with AsyncProducer(spec.name, etcd=registry, amqp_url=rabbitmq, window=50) as p:
            # When each key gets 2 messages by publish, 3 by one publish_many, 5 by send
            receipts = [await p.publish(k, f"{k}:{s}") for s in range(2) for k in keys]
            receipts += await p.publish_many(
                [(k, f"{k}:{s}".encode()) for s in range(2, 5) for k in keys]
            )
            sent = [await p.send(k, f"{k}:{s}") for s in range(5, 10) for k in keys]
            await p.flush(timeout=60)
            assert all(f.done() for f in sent)
            return receipts + [f.result() for f in sent]

    receipts = run(main())
    # Then every message was confirmed with its key's partition and its own id
    expected = [k for _s in range(10) for k in keys]
    assert [r.partition for r in receipts] == [partition_for(k, P) for k in expected]
    assert len({r.message_id for r in receipts}) == 400
    # And each key's messages were consumed in publish order, once each
    assert bodies_by_key(rabbitmq, spec) == {k: list(range(10)) for k in keys}


def test_the_loop_keeps_turning_while_10000_messages_publish(
    make_stream: MakeStream, registry: Registry, rabbitmq: str
) -> None:
    # Given a ticker task measuring how long the event loop is held at a time
    spec = make_stream(P, "quorum")
    keys = [f"k{i}" for i in range(100)]

    def message(i: int) -> tuple[str, str]:
        return keys[i % 100], f"{keys[i % 100]}:{i // 100}"

    async def main() -> Ticker:
        async with ticking() as ticker:
            # When an AsyncProducer connects (etcd, RabbitMQ), publishes 10,000 messages in
            # one publish_many call, then 2,000 by send in a loop that never awaits a confirm,
            # then 2,000 by send_many of 100 (batches that do not each give the loop a turn)
            ticker.phase = "open"
            async with AsyncProducer(spec.name, etcd=registry, amqp_url=rabbitmq) as p:
                ticker.phase = "publish_many"
                await p.publish_many([message(i) for i in range(10_000)])
                ticker.phase = "send"
                for i in range(10_000, 12_000):
                    await p.send(*message(i))
                ticker.phase = "send_many"
                for start in range(12_000, 14_000, 100):
                    await p.send_many([message(i) for i in range(start, start + 100)])
                await p.flush(timeout=60)
                ticker.phase = "close"
            return ticker

    ticker = run(main())
    print(ticker)  # shown with pytest -rP
    # Then the ticker ran while the producer connected and while it published
    phases = ("open", "publish_many", "send", "send_many")
    assert min(ticker.ticks[phase] for phase in phases) >= 1, str(ticker)
    # And the loop was never busy for 30 ms at a stretch (measured: under 10 ms; checking
    # 10,000 messages at once takes 55-85 ms), nor kept from running for 2 s (a backstop
    # that includes the machine's own delays: 0.7 s at load 44 on 2 cores)
    assert ticker.max_cpu < 0.03, str(ticker)
    assert ticker.max_lag < 2.0, str(ticker)
    # And every message arrived, in order per key
    assert bodies_by_key(rabbitmq, spec) == {k: list(range(140)) for k in keys}


# -- errors: the Producer's, raised the same way ----------------------------------------------


def test_errors_are_the_producers(
    make_stream: MakeStream, registry: Registry, rabbitmq: str, stream_name: str
) -> None:
    spec = make_stream(P, "classic")

    async def main() -> None:
        # Given a stream that was never created: opening raises StreamNotFound with the fix
        with pytest.raises(StreamNotFound, match=f"partq stream create {stream_name}x"):
            async with AsyncProducer(stream_name + "x", etcd=registry, amqp_url=rabbitmq):
                pass
        producer = AsyncProducer(spec.name, etcd=registry, amqp_url=rabbitmq)
        # And publishing before open says how to open it
        with pytest.raises(UsageError, match="async with AsyncProducer"):
            await producer.publish("k", b"v")
        async with producer as p:
            # When a key is not str or bytes: TypeError, for publish and for a batch
            with pytest.raises(TypeError):
                await p.publish(42, b"v")  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                await p.publish_many([("a", b"1"), (42, b"2")])  # type: ignore[list-item]
            # And partq's control header is refused, as the Producer refuses it
            with pytest.raises(UsageError, match="x-partq-control"):
                await p.publish("k", b"v", headers={HEADER_CONTROL: "redrive"})
            with pytest.raises(UsageError, match="header 'n'"):
                await p.publish_many([("a", b"1"), ("b", b"2", {"n": 2**64})])
            # And none of the refused batches was sent: this is the one message that arrives
            assert (await p.publish("ok", b"ok:0")).partition == partition_for("ok", P)
        # And a closed producer raises ProducerClosed
        with pytest.raises(ProducerClosed, match="create a new one"):
            await producer.publish("k", b"v")
        with pytest.raises(ProducerClosed):
            await producer.publish_many([("k", b"v")])

    run(main())
    assert bodies_by_key(rabbitmq, spec) == {"ok": [0]}


def test_a_failed_message_fails_its_own_await(make_stream: MakeStream, rabbitmq: str) -> None:
    # Given a stream whose partition 3 queue was unbound from the exchange
    spec, keys, lost_keys = unbound_partition(make_stream, rabbitmq)
    lost = set(lost_keys)

    async def main() -> None:
        async with AsyncProducer(spec, amqp_url=rabbitmq) as p:
            # When a key of partition 3 is published: MessageUnroutable, naming it
            with pytest.raises(MessageUnroutable, match="partition 3"):
                await p.publish(lost_keys[0], b"x")
            # And send_many gives each message its own outcome
            futures = await p.send_many([(k, k.encode()) for k in keys])
            await asyncio.wait(futures, timeout=30)
            for key, future in zip(keys, futures, strict=True):
                error = future.exception()
                assert isinstance(error, MessageUnroutable) if key in lost else error is None
            # And publish_many raises the batch's first failure once all are settled
            with pytest.raises(MessageUnroutable):
                await p.publish_many([(k, k.encode()) for k in keys])

    run(main())
    delivered = drain(rabbitmq, spec)
    routed = [k for k in keys if k not in lost]
    assert sorted(d.key for d in delivered) == sorted(routed * 2)  # type: ignore[type-var]


# -- cancellation: a cancelled await stops waiting; the message goes on ------------------------


def test_a_cancelled_publish_is_still_confirmed_and_flushed(
    make_stream: MakeStream, rabbitmq: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a stream with an unbound partition (its messages fail as unroutable)
    spec, _keys, lost_keys = unbound_partition(make_stream, rabbitmq)
    good = next(k for k in _keys if k not in lost_keys)

    async def main() -> tuple[int, int]:
        async with AsyncProducer(spec, amqp_url=rabbitmq, window=20) as p:
            # When a publish is cancelled once it has handed its message over
            tasks = [
                asyncio.create_task(p.publish(good, f"{good}:0")),
                asyncio.create_task(p.publish(lost_keys[0], f"{lost_keys[0]}:0")),
            ]
            await asyncio.sleep(0)  # each ran to its first await: the confirm's
            assert len(p._waiting) == 2
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=10)
            assert all(task.cancelled() for task in tasks)
            # Then flush still waits for both messages
            await p.flush(timeout=30)
            waiting = len(p._waiting)
            # And a publish_many cancelled midway handed over the head of its batch only
            items = [(good, f"{good}:{i}") for i in range(1, 1001)]
            batch = asyncio.create_task(p.publish_many(items))
            for _ in range(1000):
                await asyncio.sleep(0.001)
                if len(p._waiting) >= 20:  # the window is full: at least one chunk is out
                    break
            batch.cancel()
            await asyncio.wait([batch], timeout=10)
            await p.flush(timeout=30)
            return waiting, len(p._waiting)

    with caplog.at_level(logging.WARNING, logger="partq.producer"):
        assert run(main()) == (0, 0)
    # And the failure of the cancelled unroutable publish was logged, not lost
    assert "a message whose publish was cancelled failed" in caplog.text
    assert "partition 3" in caplog.text
    # And the confirmed messages arrived: the cancelled one, then a prefix of the batch, in order
    seqs = bodies_by_key(rabbitmq, spec)[good]
    assert 20 <= len(seqs) < 1001
    assert seqs == list(range(len(seqs)))


# -- connection loss: republish in order, as the Producer does ---------------------------------


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_connection_loss_keeps_per_key_order(
    make_stream: MakeStream,
    rabbitmq: str,
    rabbitmqctl: Ctl,
    queue_type: QueueType,
    publish_counts: collections.Counter[str],
) -> None:
    # Given an AsyncProducer publishing keyed messages continuously from a task
    spec = make_stream(P, queue_type)
    name = f"partq-test-{uuid.uuid4().hex[:12]}"
    sent: list[asyncio.Future[Receipt]] = []

    async def publish_forever(p: AsyncProducer) -> None:
        seq = 0
        while True:
            for k in range(50):
                sent.append(await p.send(f"key-{k}", f"key-{k}:{seq}"))
            seq += 1

    async def until(what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def main() -> Ticker:
        async with ticking() as ticker:
            async with AsyncProducer(spec, amqp_url=rabbitmq, window=200, name=name) as p:
                task = asyncio.create_task(publish_forever(p))
                await until("500 confirms", lambda: sum(f.done() for f in sent) >= 500, 20)
                # When the broker closes the producer's connection under it (rabbitmqctl
                # runs in a thread: the loop goes on)
                await asyncio.to_thread(close_connection, rabbitmqctl, name)
                closed_at = len(sent)
                # And publishing goes on until 1,000 more are confirmed on a new connection
                await until(
                    "1,000 confirms after the close",
                    lambda: sum(f.done() for f in sent[closed_at:]) >= 1000,
                    30,
                )
                task.cancel()
                await asyncio.wait([task], timeout=10)
                await p.flush(timeout=30)
                pids = await asyncio.to_thread(connection_pids, rabbitmqctl, name)
                assert len(pids) == 1  # it reconnected
            return ticker

    ticker = run(main())
    # Then every message confirmed
    assert [f.exception() for f in sent if f.exception() is not None] == []
    confirmed = {f.result().message_id for f in sent}
    # And what was unconfirmed at the close was republished once, keeping per-key order
    again = assert_republished_in_order(rabbitmq, spec, confirmed, publish_counts, window=200)
    print(f"\n{again} republished after the connection loss")
    # And the loop kept turning through the reconnect
    assert ticker.max_cpu < 0.03 and ticker.max_lag < 2.0, str(ticker)
