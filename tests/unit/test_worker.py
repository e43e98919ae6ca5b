"""A partition worker with fakes around it: what happens to bad messages and bad handlers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

import pika
import pytest
from partq.consumers.broker.port import END, Delivery
from partq.consumers.handling.message import Message
from partq.consumers.handling.watchdog import Watchdogs
from partq.consumers.handling.worker import CRASH, HANDLER_TIMEOUT, Worker
from partq.producer.contract import StreamSpec
from prometheus_client import REGISTRY

from tests.polling import wait_until

SPEC = StreamSpec("orders", 4)
PARTITION = 2


class Channel:
    is_open = True


class Broker:
    def __init__(self) -> None:
        self.acked: list[int] = []
        self.closed: list[int] = []
        self.finished = threading.Event()

    def ack(self, partition: int, channel: Any, tag: int) -> None:
        assert partition == PARTITION
        self.acked.append(tag)

    def finish(self, partition: int, channel: Any) -> None:
        self.finished.set()

    def close_channel(self, partition: int, channel: Any) -> None:
        self.closed.append(partition)


class Session:
    ttl = 5

    def __init__(self) -> None:
        self.lost = threading.Event()
        self.renewed = threading.Event()  # fresh once set
        self.renewed.set()
        self.waits = 0

    def fresh(self) -> bool:
        return self.renewed.is_set()

    def wait_fresh(self, timeout: float) -> bool:
        self.waits += 1
        return self.renewed.wait(min(timeout, 0.05)) and not self.lost.is_set()


class DeadLetters:
    def __init__(self) -> None:
        self.published: list[tuple[str | None, BaseException, int]] = []

    def publish(self, delivery: Delivery, error: BaseException, attempts: int) -> None:
        self.published.append((delivery.properties.message_id, error, attempts))


class Run:
    """One worker on partition 2 with a recording handler wrapped around ``behaviour``."""

    def __init__(self, behaviour: Any = None, **options: Any) -> None:
        self.member = f"m-{uuid.uuid4().hex[:8]}"
        self.broker = Broker()
        self.dead = DeadLetters()
        self.seen: list[tuple[str | None, int, int]] = []  # (message id, attempt, count)
        self.handled: list[str | None] = []
        self.failures: list[tuple[int, str]] = []
        self.failed = threading.Event()
        self.channel = Channel()
        self.session = Session()
        self.tag = 0

        def handler(message: Message) -> object:
            self.seen.append((message.message_id, message.attempt, message.delivery_count))
            result = None if behaviour is None else behaviour(message)
            self.handled.append(message.message_id)
            return result

        def on_failure(partition: int, reason: str) -> None:
            self.failures.append((partition, reason))
            self.failed.set()

        self.worker = Worker(
            spec=SPEC,
            partition=PARTITION,
            member=self.member,
            handler=handler,
            broker=self.broker,  # type: ignore[arg-type]
            session=self.session,  # type: ignore[arg-type]
            dead_letters=self.dead,  # type: ignore[arg-type]
            max_attempts=options.pop("max_attempts", 3),
            retry_backoff=0.001,
            previous=None,
            freed_at=None,
            on_failure=on_failure,
            **options,
        )
        self.worker.start()

    def deliver(
        self, message_id: str, headers: dict[str, Any] | None = None, user_id: str | None = None
    ) -> int:
        self.tag += 1
        if headers is None:
            headers = {"partq-key": "k", "partq-partition": PARTITION, "partq-published-ms": 1}
        props = pika.BasicProperties(message_id=message_id, headers=headers, user_id=user_id)
        self.worker.inbox.put(
            Delivery(PARTITION, self.channel, self.tag, False, props, message_id.encode())  # type: ignore[arg-type]
        )
        return self.tag

    def end(self, timeout: float = 5.0) -> None:
        """Send END and wait for the worker to finish the partition."""
        self.worker.inbox.put((END, self.channel))
        assert self.broker.finished.wait(timeout)
        self.worker.join(timeout)

    def metric(self, name: str, **labels: str) -> float:
        value = REGISTRY.get_sample_value(
            name, {"stream": SPEC.name, "member": self.member, **labels}
        )
        return value or 0.0


def test_messages_are_handled_in_order_and_acked() -> None:
    run = Run()
    tags = [run.deliver(f"m{i}") for i in range(5)]
    run.end()
    assert run.handled == [f"m{i}" for i in range(5)]
    assert run.broker.acked == tags
    assert not run.failures


def test_every_message_carries_the_workers_fencing_token_on_every_attempt() -> None:
    # Given a worker started under a claim of etcd revision 41, whose handler fails once
    tokens: list[tuple[int, int]] = []

    def flaky(message: Message) -> None:
        tokens.append((message.attempt, message.fencing_token))
        if message.attempt == 1:
            raise RuntimeError("once")

    run = Run(flaky, fencing_token=41)
    run.deliver("m0")
    run.end()
    # Then both attempts saw the token
    assert tokens == [(1, 41), (2, 41)]


@pytest.mark.parametrize(
    "headers",
    [{"partq-key": "k", "partq-published-ms": "yesterday"}, {"partq-key-b64": "not*base64!"}],
)
def test_malformed_headers_are_dead_lettered_unhandled_and_the_partition_goes_on(
    headers: dict[str, Any],
) -> None:
    run = Run()
    run.deliver("before")
    bad = run.deliver("bad", headers)
    run.deliver("after")
    run.end()
    assert run.handled == ["before", "after"]
    [(message_id, error, attempts)] = run.dead.published
    assert (message_id, type(error).__name__, attempts) == ("bad", "MalformedHeaders", 0)
    assert bad in run.broker.acked and len(run.broker.acked) == 3
    assert run.metric("partq_consumer_header_problems_total", problem="malformed") == 1
    assert run.metric("partq_consumer_dead_lettered_total") == 1


def test_a_foreign_message_without_partq_headers_is_handled() -> None:
    run = Run()
    run.deliver("foreign", {})
    run.end()
    assert run.handled == ["foreign"]


def test_a_message_naming_another_partition_is_handled_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = Run()
    run.deliver("stray", {"partq-key": "k", "partq-partition": PARTITION + 1})
    run.end()
    assert run.handled == ["stray"]
    assert run.metric("partq_consumer_header_problems_total", problem="wrong_partition") == 1
    assert "wrong queue" in caplog.text


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["inline", "handler-thread"])
@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), ValueError("bad")])
def test_a_handler_raising_anything_spends_an_attempt_then_is_dead_lettered(
    error: BaseException, timeout: float | None
) -> None:
    def behaviour(message: Message) -> None:
        if message.message_id == "poison":
            raise error

    run = Run(behaviour, handler_timeout=timeout)
    run.deliver("poison", {"partq-key": "k", "x-delivery-count": 7})
    run.deliver("next")
    run.end()
    # attempts count this process's handler attempts, not the broker's deliveries
    assert run.seen == [("poison", 1, 7), ("poison", 2, 7), ("poison", 3, 7), ("next", 1, 0)]
    assert run.handled == ["next"]
    [(message_id, dead_error, attempts)] = run.dead.published
    assert (message_id, dead_error, attempts) == ("poison", error, 3)
    assert run.broker.acked == [1, 2]
    assert not run.failures


def test_a_hung_handler_is_dead_lettered_then_the_worker_stops_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def behaviour(message: Message) -> None:
        if message.message_id == "hang":
            release.wait(30)

    run = Run(behaviour, handler_timeout=0.4)
    try:
        run.deliver("first")
        hung = run.deliver("hang")
        run.deliver("after")
        began = time.monotonic()
        assert run.failed.wait(5)
        assert 0.4 <= time.monotonic() - began < 2  # noticed within a quarter of the timeout
        # the message is dead-lettered and acked, the worker reports, nothing more is handled
        assert run.failures == [(PARTITION, HANDLER_TIMEOUT)]
        [(message_id, error, attempts)] = run.dead.published
        assert (message_id, type(error).__name__, attempts) == ("hang", "HandlerTimeout", 1)
        assert run.broker.acked == [1, hung]
        assert run.metric("partq_consumer_worker_failures_total", reason=HANDLER_TIMEOUT) == 1
        assert "timed out after 0.4s on message hang" in caplog.text
    finally:
        release.set()
    # When the handler returns after all, its result is dropped and the worker ends
    run.worker.join(5)
    assert not run.worker.is_alive()
    assert run.seen == [("first", 1, 0), ("hang", 1, 0)]
    assert run.handled == ["first", "hang"]  # it did finish, late
    assert run.broker.acked == [1, hung]  # but nothing was acked twice, "after" never ran


def test_a_handler_within_its_timeout_is_not_disturbed() -> None:
    def behaviour(message: Message) -> None:
        time.sleep(0.05)

    run = Run(behaviour, handler_timeout=0.2)
    tags = [run.deliver(f"m{i}") for i in range(8)]  # 0.4 s in all: longer than the timeout
    run.end()
    assert run.handled == [f"m{i}" for i in range(8)]
    assert run.broker.acked == tags
    assert not run.failures


def test_a_worker_that_fails_outside_the_handler_reports_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="partq.consumer.worker")
    run = Run()

    def broken_ack(partition: int, channel: Any, tag: int) -> None:
        raise RuntimeError("the ack failed")

    run.broker.ack = broken_ack  # type: ignore[method-assign]
    run.deliver("m0")
    assert run.failed.wait(5)
    run.worker.join(5)
    assert not run.worker.is_alive()
    assert run.failures == [(PARTITION, CRASH)]
    assert run.worker.failure == CRASH
    assert run.metric("partq_consumer_worker_failures_total", reason=CRASH) == 1
    assert "the worker failed" in caplog.text and "RuntimeError: the ack failed" in caplog.text


def test_a_stale_lease_is_waited_out_not_skipped() -> None:
    # Given a worker whose lease has not been renewed lately (etcd electing a leader)
    run = Run()
    run.session.renewed.clear()
    run.deliver("first")
    run.deliver("second")
    deadline = time.monotonic() + 5
    while run.session.waits < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.handled == []  # nothing handled while the lease is stale
    # When the lease is renewed, the channel still open
    run.session.renewed.set()
    run.end()
    # Then both are handled, in order: none was skipped and left unacked on the channel
    assert run.handled == ["first", "second"]
    assert run.broker.acked == [1, 2]


def test_a_lost_lease_leaves_the_delivery_to_the_fence() -> None:
    # Given a worker whose lease is lost (the daemon is fencing: it aborts the connection)
    run = Run()
    run.session.renewed.clear()
    run.session.lost.set()
    run.deliver("first")
    run.end()
    # Then it is neither handled nor acked, and its channel is not closed gracefully: that
    # would let a waiting next owner be served newer messages first (docs/benchmarks.md,
    # "Fencing"); the aborted connection gives it back to the next owner, first
    assert run.handled == []
    assert run.broker.acked == []
    assert run.broker.closed == []


def test_a_stopped_worker_gives_back_by_closing_its_channel() -> None:
    # Given a worker stopped (not fenced) with a delivery it has not handled
    run = Run()
    run.worker.stopped.set()
    run.deliver("first")
    run.end()
    # Then its channel is closed so that the broker requeues it
    assert run.handled == []
    assert run.broker.closed == [PARTITION]


def test_a_waiter_never_takes_an_expired_lease_for_a_renewal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from partq.coordinator.store.session import Session as RealSession

    class Client:
        """A lease that expires at its first renewal (etcd says TTL 0)."""

        def lease(self, ttl: int) -> Any:
            return SimpleNamespace(id=1)

        def refresh_lease(self, lease_id: int) -> Any:
            return [SimpleNamespace(TTL=0)]

    lose = RealSession._lose

    def slow_lose(self: RealSession) -> None:  # a busy machine: the waiter runs first
        time.sleep(0.3)
        lose(self)

    monkeypatch.setattr(RealSession, "_lose", slow_lose)
    session = RealSession(Client(), "test", ttl=1)
    session.last_tick -= 10  # stale, as after a freeze
    try:
        # When a waiter wakes at the refresher's tick, the lease is already known lost
        assert session.wait_fresh(5) is False
        assert session.lost.is_set()
    finally:
        session.close(revoke=False)


def test_a_handler_returning_a_coroutine_has_it_awaited_before_the_ack() -> None:
    # Given a handler whose coroutines sleep, and fail for one message
    ran: list[str | None] = []

    async def work(message: Message) -> None:
        await asyncio.sleep(0.05)
        if message.message_id == "bad":
            raise ValueError("async failure")
        ran.append(message.message_id)

    run = Run(work)
    # When three are delivered
    run.deliver("lazy")
    run.deliver("bad")
    run.deliver("next")
    run.end()  # filterwarnings = error: an unawaited coroutine's RuntimeWarning would fail it
    # Then each coroutine ran to its end, and a raising one was retried, then dead-lettered
    assert ran == ["lazy", "next"]
    [(message_id, error, attempts)] = run.dead.published
    assert (message_id, str(error), attempts) == ("bad", "async failure", 3)
    assert run.broker.acked == [1, 2, 3]
    assert run.metric("partq_consumer_messages_handled_total", outcome="ok") == 2
    assert run.metric("partq_consumer_messages_handled_total", outcome="retry") == 2


def test_an_awaitable_is_not_acked_before_it_finishes() -> None:
    # Given an async handler that waits for a gate
    gate = threading.Event()

    async def work(message: Message) -> None:
        while not gate.is_set():
            await asyncio.sleep(0.01)

    run = Run(work)
    run.deliver("m1")
    # When it has started but not finished, then nothing is acked
    wait_until(lambda: run.worker.busy, 5, 0.01, "the handler to start")
    time.sleep(0.2)  # it stays unacked while the coroutine waits
    assert run.broker.acked == []
    gate.set()
    run.end()
    assert run.broker.acked == [1]


def test_one_watchdog_thread_serves_every_worker_of_a_member() -> None:
    # Given three workers of one member sharing its watchdog, one handler hanging
    release = threading.Event()

    def behaviour(message: Message) -> None:
        if message.message_id == "hang":
            release.wait(30)

    watchdogs = Watchdogs(0.4)
    runs = [Run(behaviour, handler_timeout=0.4, watchdogs=watchdogs) for _ in range(3)]
    try:
        for run in runs:
            run.deliver("first")
        runs[2].deliver("hang")
        # Then one thread watches all three, and it gives up on the hanging call alone
        assert runs[2].failed.wait(5)
        assert [t.name for t in threading.enumerate()].count("watchdog") == 1
        assert runs[2].failures == [(PARTITION, HANDLER_TIMEOUT)]
        assert not runs[0].failures and not runs[1].failures
    finally:
        release.set()
    for run in runs[:2]:
        run.end()
    runs[2].worker.join(5)
    # And with no worker left, the thread ends
    wait_until(
        lambda: "watchdog" not in [t.name for t in threading.enumerate()],
        5,
        what="the watchdog thread to end",
    )
