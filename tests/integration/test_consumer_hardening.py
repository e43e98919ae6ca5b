"""A consumer never dies silently: bad input and bad handlers, on real etcd and RabbitMQ.

One test per way a consumer used to stop consuming without telling anyone
(issue 8): a malformed partq header, a handler calling ``sys.exit()`` or raising
``KeyboardInterrupt``, a hung handler, a worker that dies, a stream deleted
under running consumers. Consumers run as OS processes (``partq consume`` with
``hardening_handlers.misbehave``) where the exit code or ``/readyz`` is the
point, in-process where a fault must be injected. Every handled message is
checked for per-key order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from partq.consumers.control.daemon import Consumer, ConsumerConfig
from partq.consumers.handling.message import Message
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry
from prometheus_client import REGISTRY

from examples import audit as checker
from partq.kernel.settings import Settings

from .groups.harness import Fleet, Proc, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 2
KEYS = [f"key-{i}" for i in range(6)]
HANDLER = "tests.integration.hardening_handlers:misbehave"


@dataclass
class Env:
    fleet: Fleet
    group: Group
    spec: StreamSpec
    registry: Registry
    amqp: str


@pytest.fixture
def env(
    registry: Registry, settings: Settings, rabbitmq: str, stream_name: str, tmp_path: Path
) -> Iterator[Env]:
    spec = StreamSpec(stream_name, P, "quorum")
    admin.create_stream(registry, rabbitmq, spec)
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, rabbitmq, tmp_path / "rec.jsonl")
    try:
        yield Env(
            fleet, Group(registry.client, registry.where, stream_name), spec, registry, rabbitmq
        )
    finally:
        fleet.close()
        with contextlib.suppress(Exception):
            admin.delete(registry, rabbitmq, stream_name)


# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consumer(env: Env, member: str, *extra: str) -> tuple[Proc, int]:
    """``partq consume`` with the misbehaving handler; returns the process and its HTTP port."""
    port = free_port()
    args = ["--debug", "consume", env.fleet.stream, "--handler", HANDLER, "--member-id", member]
    args += ["--ttl", "2", "--http-port", str(port), "--drain-timeout", "15", *extra]
    return env.fleet._start(member, args, env.fleet._env(PARTQ_MEMBER_ID=member)), port


def readyz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def publish(spec: StreamSpec, amqp: str, seqs: range, keys: list[str] = KEYS) -> set[Any]:
    """Publish ``{"key", "seq"}`` for every key and seq (confirmed, seq order per key)."""
    sent = set()
    with Producer(spec, amqp_url=amqp, name="partq-test-hardening") as producer:
        for seq in seqs:
            for key in keys:
                body = json.dumps({"key": key, "seq": seq})
                producer.publish(key, body, message_id=f"{key}:{seq}").result(10)
                sent.add((key, seq))
    return sent


def publish_raw(amqp: str, queue: str, body: bytes, headers: dict[str, Any], mid: str) -> None:
    """Straight into a partition queue, as a foreign or broken producer would."""
    with pika.BlockingConnection(pika.URLParameters(amqp)) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2, headers=headers, message_id=mid)
        channel.basic_publish("", queue, body, props, mandatory=True)


def dead_letter(spec: StreamSpec, amqp: str) -> tuple[Any, bytes] | None:
    with pika.BlockingConnection(pika.URLParameters(amqp)) as connection:
        channel = connection.channel()
        method, props, body = channel.basic_get(spec.dead_letter_queue, auto_ack=True)
        return (props, body) if method else None


def handled(fleet: Fleet, published: set[Any], timeout: float = 30.0) -> list[dict[str, Any]]:
    try:
        wait_until(
            lambda: not checker.lost(published, fleet.records()),
            timeout,
            interval=0.25,
            what="every published message handled",
        )
    except AssertionError:
        print(fleet.logs())
        raise
    records = fleet.records()
    assert checker.order_violations(records) == []
    return records


def bad_key_partition(spec: StreamSpec) -> tuple[str, int]:
    """The key that gets the bad message, and its partition."""
    return KEYS[0], spec.partition_for(KEYS[0])


# -- malformed partq headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "value"),
    [("partq-published-ms", "yesterday"), ("partq-key-b64", "not*base64!")],
)
def test_a_malformed_partq_header_is_dead_lettered_and_the_partition_flows(
    env: Env, header: str, value: str
) -> None:
    # Given a consumer and, in the middle of a key's sequence, a message published straight
    # into the key's partition queue with one unparseable partq header
    key, partition = bad_key_partition(env.spec)
    env.fleet.coordinator()
    proc, port = consumer(env, "c1")
    published = publish(env.spec, env.amqp, range(5))
    headers: dict[str, Any] = {
        "partq-key": key,
        "partq-partition": partition,
        "partq-published-ms": int(time.time() * 1000),
    }
    if header == "partq-key-b64":
        del headers["partq-key"]
    headers[header] = value
    body = json.dumps({"key": key, "seq": -1}).encode()
    publish_raw(env.amqp, env.spec.queue(partition), body, headers, f"{key}:bad")
    published |= publish(env.spec, env.amqp, range(5, 10))

    # Then the partition flows on: every other message is handled, in order per key
    records = handled(env.fleet, published)
    assert not [r for r in records if r["seq"] == -1]
    # and the bad one is in the DLQ, saying which header was wrong
    props, dead = wait_until(
        lambda: dead_letter(env.spec, env.amqp), 10, interval=0.25, what="the dead letter"
    )
    assert dead == body and props.message_id == f"{key}:bad"
    assert props.headers["x-partq-error-type"] == "MalformedHeaders"
    assert header in props.headers["x-partq-error"] and value in props.headers["x-partq-error"]
    # and the consumer is alive and ready
    assert proc.alive() and readyz(port) == 200, proc.tail()


# -- handlers that raise BaseException -------------------------------------------------------


@pytest.mark.parametrize(
    ("word", "error_type"), [("sys-exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")]
)
def test_a_handler_raising_a_base_exception_is_a_failed_attempt(
    env: Env, word: str, error_type: str
) -> None:
    # Given a handler that calls sys.exit() / raises KeyboardInterrupt for one message
    key, _ = bad_key_partition(env.spec)
    env.fleet.coordinator()
    proc, port = consumer(env, "c1", "--max-attempts", "2")
    published = publish(env.spec, env.amqp, range(5))
    with Producer(env.spec, amqp_url=env.amqp) as producer:
        producer.publish(
            key, json.dumps({"key": key, "seq": 5, word: 1}), message_id=f"{key}:5"
        ).result(10)
    published |= publish(env.spec, env.amqp, range(6, 10))

    # Then it is retried, dead-lettered with the reason, and the partition flows on in order
    records = handled(env.fleet, published)
    assert not [r for r in records if (r["key"], r["seq"]) == (key, 5)]
    props, _ = wait_until(
        lambda: dead_letter(env.spec, env.amqp), 10, interval=0.25, what="the dead letter"
    )
    assert props.message_id == f"{key}:5"
    assert props.headers["x-partq-error-type"] == error_type
    assert props.headers["x-partq-attempts"] == 2
    assert proc.alive() and readyz(port) == 200, proc.tail()


# -- a hung handler ----------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["hang", "hang-hard"])
def test_a_hung_handler_is_dead_lettered_and_the_member_exits_for_a_restart(
    env: Env, word: str
) -> None:
    # Given a consumer with a 1 s handler timeout and a message its handler never returns from
    # ("hang-hard": the handler also left a thread behind that would keep the process alive)
    key, _ = bad_key_partition(env.spec)
    env.fleet.coordinator()
    c1, _ = consumer(env, "c1", "--handler-timeout", "1")
    published = publish(env.spec, env.amqp, range(5))
    with Producer(env.spec, amqp_url=env.amqp) as producer:
        producer.publish(
            key, json.dumps({"key": key, "seq": 5, word: 1}), message_id=f"{key}:5"
        ).result(10)
    published |= publish(env.spec, env.amqp, range(6, 10))

    # Then the member leaves the group and exits with the documented code (3), in bounded time
    try:
        wait_until(lambda: not c1.alive(), 40, what="c1 to exit")
    except AssertionError:
        print(c1.tail())
        raise
    assert c1.popen.returncode == 3, c1.tail()
    assert "timed out" in c1.log.read_text()
    # and the hung message is in the DLQ with the reason, so a restart does not meet it again
    props, _ = wait_until(
        lambda: dead_letter(env.spec, env.amqp), 10, interval=0.25, what="the dead letter"
    )
    assert props.message_id == f"{key}:5"
    assert props.headers["x-partq-error-type"] == "HandlerTimeout"
    # and the next consumer (the restarted one) handles the rest of the partition, in order
    c2, port = consumer(env, "c2", "--handler-timeout", "1")
    records = handled(env.fleet, published)
    assert not [r for r in records if (r["key"], r["seq"]) == (key, 5)]
    assert c2.alive() and readyz(port) == 200, c2.tail()


# -- in-process consumers (faults injected, deletion) ----------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        start = time.time()
        body = json.loads(message.body)
        with self._lock:
            self.records.append(
                {
                    "key": message.key,
                    "seq": body["seq"],
                    "partition": message.partition,
                    "start": start,
                    "end": time.time(),
                    "pid": os.getpid(),
                }
            )

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.records)


class Running:
    """A Consumer running in a thread of this process."""

    def __init__(self, env: Env, member: str, handler: Any) -> None:
        config = ConsumerConfig(env.spec.name, member_id=member, ttl=2, drain_timeout=10)
        self.consumer = Consumer(env.registry, handler, config, amqp_url=env.amqp)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"consumer-{member}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.consumer.run()

    def close(self) -> int | None:
        if self.thread.is_alive():
            self.consumer.stop()
            self.thread.join(30)
        return self.code


@contextlib.contextmanager
def coordinating(env: Env) -> Iterator[StreamCoordinator]:
    coordinator = StreamCoordinator(
        env.registry, env.spec.name, CoordinatorConfig(settle=0.3, ttl=2)
    )
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.stop()
        coordinator.join(15)


def wait_handled(recorder: Recorder, published: set[Any], timeout: float = 30.0) -> None:
    wait_until(
        lambda: not checker.lost(published, recorder.snapshot()),
        timeout,
        interval=0.25,
        what="every published message handled",
    )
    assert checker.order_violations(recorder.snapshot()) == []


def test_a_dead_worker_turns_readyz_false_and_the_member_leaves_and_exits(env: Env) -> None:
    # Given a consumer whose worker for one partition dies outside the handler (an injected
    # failure of its fourth ack)
    _, partition = bad_key_partition(env.spec)
    recorder = Recorder()
    with coordinating(env):
        c1 = Running(env, "c1", recorder)
        acks = 0
        real_ack = c1.consumer.broker.ack

        def failing_ack(p: int, channel: Any, tag: int) -> None:
            nonlocal acks
            if p == partition:
                acks += 1
                if acks == 4:
                    raise RuntimeError("injected: the ack failed")
            real_ack(p, channel, tag)

        c1.consumer.broker.ack = failing_ack  # type: ignore[method-assign]
        try:
            wait_until(c1.consumer.ready.is_set, 15, what="c1 ready")
            published = publish(env.spec, env.amqp, range(5))

            # Then /readyz turns false, the member leaves the group and run() returns 4
            wait_until(lambda: not c1.consumer.ready.is_set(), 15, what="c1 not ready")
            wait_until(lambda: not c1.thread.is_alive(), 30, what="c1 to exit")
            assert c1.code == 4
            state = env.group.snapshot()
            assert "c1" not in state.members
            assert all(claim.member != "c1" for claim in state.claims.values())
            failures = REGISTRY.get_sample_value(
                "partq_consumer_worker_failures_total",
                {"stream": env.spec.name, "member": "c1", "reason": "crash"},
            )
            assert failures == 1
        finally:
            c1.close()

        # and the next member takes the partition over and handles everything, in key order
        c2 = Running(env, "c2", recorder)
        try:
            wait_handled(recorder, published)
            assert c2.consumer.ready.is_set()
        finally:
            assert c2.close() == 0


def test_a_deleted_stream_turns_readyz_false_and_the_member_rejoins_when_it_is_recreated(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="partq.consumer")
    recorder = Recorder()
    c1 = Running(env, "c1", recorder)
    try:
        with coordinating(env):
            wait_until(lambda: balanced(env.group, P, {"c1"}), 15, what="c1 owns everything")
            wait_until(c1.consumer.ready.is_set, 15, what="c1 ready")
            published = publish(env.spec, env.amqp, range(3))
            wait_handled(recorder, published)

            # When the stream is deleted under the running consumer
            admin.delete(env.registry, env.amqp, env.spec.name)

            # Then it reports it: /readyz false, a log line; and it keeps running
            wait_until(lambda: not c1.consumer.ready.is_set(), 15, what="c1 not ready")
            assert "was deleted" in caplog.text
            assert c1.thread.is_alive()

        # When the stream is created again (with a coordinator for it)
        admin.create_stream(env.registry, env.amqp, env.spec)
        with coordinating(env):
            # Then the member rejoins, owns the partitions, is ready and consumes, in order
            wait_until(lambda: balanced(env.group, P, {"c1"}), 20, what="c1 rejoined")
            wait_until(c1.consumer.ready.is_set, 15, what="c1 ready again")
            published |= publish(env.spec, env.amqp, range(3, 6))
            wait_handled(recorder, published)
    finally:
        assert c1.close() == 0


def test_a_stream_recreated_with_other_partitions_makes_the_member_exit(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="partq.consumer")
    c1 = Running(env, "c1", Recorder())
    try:
        with coordinating(env):
            wait_until(lambda: balanced(env.group, P, {"c1"}), 15, what="c1 owns everything")
            admin.delete(env.registry, env.amqp, env.spec.name)
            wait_until(lambda: not c1.consumer.ready.is_set(), 15, what="c1 not ready")

        # When the stream comes back with another partition count
        admin.create_stream(env.registry, env.amqp, StreamSpec(env.spec.name, P + 1, "quorum"))

        # Then the member exits with the documented code (5), saying why
        wait_until(lambda: not c1.thread.is_alive(), 15, what="c1 to exit")
        assert c1.code == 5
        assert f"{P + 1} partitions" in caplog.text
    finally:
        c1.close()
