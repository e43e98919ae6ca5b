"""A consumer is a member only while it can consume, on real etcd and RabbitMQ.

A consumer that cannot use RabbitMQ (a wrong password) must not take partitions: it never
joins, ``/readyz`` is false, the others consume everything, and SIGTERM ends it at once.
A prefetch RabbitMQ cannot take is a usage error at start (exit 2, one line); an async
handler, and a sync one returning a coroutine, have their coroutines awaited.
A member whose broker goes away for longer than the outage limit leaves the group, and
rejoins once the broker is back (a private RabbitMQ node, stopped and started).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pika
import pytest
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.settings import Settings
from tests.rabbit import Install, PrivateRabbit

from .groups.harness import PARTQ, ROOT, Fleet, Proc, balanced, wait_until
from .test_consumer_hardening import free_port, readyz

pytestmark = [pytest.mark.integration]

P = 4
KEYS = [f"key-{i}" for i in range(8)]
ASYNC = "tests.integration.hardening_handlers:"


def consumer(fleet: Fleet, member: str, *extra: str, handler: str = "record", **env: str) -> int:
    """A ``partq consume`` process on its own HTTP port (returned)."""
    port = free_port()
    args = ["consume", fleet.stream, "--handler", handler_path(handler), "--member-id", member]
    args += ["--ttl", "2", "--http-port", str(port), "--drain-timeout", "10", *extra]
    fleet._start(member, args, fleet._env(PARTQ_MEMBER_ID=member, **env))
    return port


def handler_path(name: str) -> str:
    if ":" in name:
        return name
    return f"tests.integration.groups.recorder:{name}"


def proc(fleet: Fleet, member: str) -> Proc:
    return next(p for p in fleet.procs if p.name == member)


def publish(spec: StreamSpec, amqp: str, seqs: range) -> set[tuple[str, int]]:
    sent = set()
    with Producer(spec, amqp_url=amqp, name="partq-test-membership") as producer:
        for seq in seqs:
            for key in KEYS:
                body = json.dumps({"key": key, "seq": seq})
                producer.publish(key, body, message_id=f"{key}:{seq}")
                sent.add((key, seq))
        producer.flush(30)
    return sent


def run_partq(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PARTQ), *args], env=fleet._env(), cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


def wrong_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = f"{parts.username}:not-the-password@{parts.hostname}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def coordinated(
    quorum_fleet: Callable[..., Fleet], registry: Registry
) -> tuple[Fleet, StreamSpec, Group]:
    """A quorum stream of P partitions with its coordinator running."""
    fleet = quorum_fleet(P)
    fleet.coordinator(settle=0.5)
    group = Group(registry.client, registry.where, fleet.stream)
    return fleet, StreamSpec(fleet.stream, P, "quorum"), group


def test_a_consumer_that_cannot_log_in_owns_nothing_and_the_others_consume_everything(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a group with a working member and one whose AMQP password is wrong
    fleet, spec, group = coordinated(quorum_fleet, registry)
    consumer(fleet, "good")
    bad_port = consumer(fleet, "bad", PARTQ_AMQP_URL=wrong_password(rabbitmq))
    wait_until(lambda: balanced(group, P, {"good"}), 30, 0.1, "good owning every partition")
    wait_until(lambda: "cannot connect" in proc(fleet, "bad").tail(), 30, 0.2, "bad refused")
    # When messages are published to every partition
    sent = publish(spec, rabbitmq, range(50))
    # Then the working member handles all of them, in order per key
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "every message handled")
    assert audit.order_violations(fleet.records()) == []
    # And the other never joined: it owns and claims nothing, and is not ready
    state = group.snapshot()
    assert set(state.members) == {"good"}, proc(fleet, "bad").tail()
    assert {c.member for c in state.claims.values()} == {"good"}
    assert readyz(bad_port) == 503
    # And SIGTERM ends it well within its drain timeout
    bad = proc(fleet, "bad")
    started = time.monotonic()
    code = bad.terminate(timeout=10)
    took = time.monotonic() - started
    assert code == 0 and took < 10, f"exit {code} after {took:.1f}s\n{bad.tail()}"
    print(f"a member that cannot log in: SIGTERM to exit {took:.2f}s")


def test_a_prefetch_rabbitmq_cannot_take_is_a_usage_error_at_start(
    quorum_fleet: Callable[..., Fleet],
) -> None:
    fleet = quorum_fleet(P)
    done = run_partq(fleet, "consume", fleet.stream, "--handler", handler_path("record"),
                     "--http-port", "0", "--prefetch", "70000")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "65535" in done.stderr, done.stderr


@pytest.mark.parametrize("handler", ["asynchronous", "asynchronous_object", "lazy"])
def test_an_async_handler_and_a_returned_coroutine_are_awaited(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, handler: str
) -> None:
    # Given a consumer with an async def handler, an async __call__, or a sync handler
    # returning a coroutine for "lazy" messages
    fleet, spec, group = coordinated(quorum_fleet, registry)
    consumer(fleet, "c1", "--max-attempts", "2", handler=f"{ASYNC}{handler}")
    wait_until(lambda: balanced(group, P, {"c1"}), 30, 0.1, "c1 owning every partition")
    # When messages are published, one of them lazy
    sent = publish(spec, rabbitmq, range(5))
    with Producer(spec, amqp_url=rabbitmq) as producer:
        body = json.dumps({"key": KEYS[0], "seq": 5, "lazy": True})
        producer.publish(KEYS[0], body, message_id="lazy").result(10)
    sent |= {(KEYS[0], 5)} | publish(spec, rabbitmq, range(6, 10))
    # Then every one is handled: the coroutines ran (they record), none was dead-lettered
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "every message handled")
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        channel = connection.channel()
        assert channel.basic_get(spec.dead_letter_queue, auto_ack=True)[0] is None
    log = proc(fleet, "c1").tail(300)
    assert "never awaited" not in log, log


# -- a broker that goes away ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.fault
def test_a_member_whose_broker_is_away_past_the_limit_leaves_then_rejoins(
    registry: Registry,
    settings: Settings,
    stream_name: str,
    tmp_path: Path,
    rabbit_install: Install,
) -> None:
    # Given a member on a private RabbitMQ node, with an outage limit of 3 s
    node = PrivateRabbit(tmp_path / "rabbit", name="partqaway", install=rabbit_install).start()
    fleet = Fleet(stream_name, tmp_path, settings.etcd_endpoints, node.url, tmp_path / "r.jsonl")
    spec = StreamSpec(stream_name, P, "quorum")
    group = Group(registry.client, registry.where, stream_name)
    try:
        admin.create_stream(registry, node.url, spec)
        fleet.coordinator(settle=0.5)
        port = consumer(fleet, "c1", PARTQ_AMQP_OUTAGE_LIMIT="3")
        wait_until(lambda: balanced(group, P, {"c1"}), 30, 0.1, "c1 owning every partition")
        wait_until(lambda: readyz(port) == 200, 15, 0.1, "c1 ready")
        # When the node stops
        stopped = time.monotonic()  # the connection drops during the stop, not before it
        node.stop(keep_data=True)
        # Then /readyz turns false, and past the limit the member leaves the group
        wait_until(lambda: readyz(port) == 503, 10, 0.1, "c1 not ready")
        wait_until(lambda: "c1" not in group.snapshot().members, 20, 0.1, "c1 gone")
        left = time.monotonic() - stopped
        assert group.snapshot().claims == {}
        assert left >= 3, f"left after {left:.1f}s, before the 3 s limit"
        # And once the node is back it rejoins, takes the partitions and consumes them
        node.start()
        wait_until(lambda: balanced(group, P, {"c1"}), 60, 0.2, "c1 back, owning everything")
        wait_until(lambda: readyz(port) == 200, 30, 0.2, "c1 ready again")
        sent = publish(spec, node.url, range(10))
        wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "handled after")
        print(f"broker away: member left {left:.1f}s after the node stopped (limit 3 s)")
    except AssertionError:
        print(fleet.logs())
        raise
    finally:
        fleet.close()
        node.stop()
