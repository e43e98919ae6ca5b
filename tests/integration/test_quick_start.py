"""A new user's first steps, as processes against a real etcd and RabbitMQ: a handler in
the folder they run ``partq consume`` from, adopting a parking stream's queues."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from partq.consumers.control.daemon import NO_LEADER_WARNING
from partq.coordinator.ops import admin
from partq.producer import Producer, StreamNotFound, StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.settings import Settings
from tests.integration.groups.harness import PARTQ, Proc
from tests.polling import wait_until

pytestmark = [pytest.mark.integration]

FIRST_HANDLER = """\
from pathlib import Path

HANDLED = Path(__file__).with_name("handled.txt")


def handle(message):
    with HANDLED.open("a") as out:
        out.write(message.body.decode() + "\\n")
"""


def partq_env(settings: Settings) -> dict[str, str]:
    """The environment of a shell with only partq's two settings (and no PYTHONPATH)."""
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("PARTQ_") and k != "PYTHONPATH"
    }
    environ["PARTQ_ETCD_ENDPOINTS"] = settings.etcd_endpoints
    environ["PARTQ_AMQP_URL"] = settings.amqp.url
    return environ


@contextlib.contextmanager
def started(name: str, args: list[str], env: dict[str, str], cwd: Path) -> Iterator[Proc]:
    """``partq ARGS`` run from ``cwd``; stopped by its PID on the way out."""
    log = cwd / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [str(PARTQ), *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    proc = Proc(name, popen, log)
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture
def stream(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[str]:
    yield stream_name
    with contextlib.suppress(StreamNotFound):
        admin.delete(registry, rabbitmq, stream_name)


def first_steps(
    settings: Settings, registry: Registry, stream: str, folder: Path
) -> tuple[StreamSpec, dict[str, str]]:
    """myhandlers.py in ``folder`` and a 2-partition stream; its spec, and the environment."""
    (folder / "myhandlers.py").write_text(FIRST_HANDLER)
    spec = StreamSpec(stream, 2, "quorum")
    admin.create_stream(registry, settings.amqp, spec)
    return spec, partq_env(settings)


def consume_args(stream: str) -> list[str]:
    return ["consume", stream, "--handler", "myhandlers:handle", "--http-port", "0"]


def coordinator_args(stream: str) -> list[str]:
    return ["coordinator", stream, "--settle", "0.5", "--http-port", "0"]


def test_a_handler_module_in_the_working_directory_is_found(
    settings: Settings, registry: Registry, stream: str, tmp_path: Path
) -> None:
    # Given myhandlers.py in the folder the user works in, and a stream with a coordinator
    spec, env = first_steps(settings, registry, stream, tmp_path)
    coordinator = coordinator_args(stream)
    # When `partq consume --handler myhandlers:handle` runs from that folder
    consume = consume_args(stream)
    with (
        started("coordinator", coordinator, env, tmp_path),
        started("consumer", consume, env, tmp_path) as consumer,
    ):
        with Producer(spec, amqp_url=settings.amqp, name="partq-test-quick-start") as producer:
            for n in range(3):
                producer.publish(f"key-{n}", f"hello {n}").result(10)

        # Then it imports the module and handles every message
        def handled() -> list[str]:
            assert consumer.alive(), f"the consumer exited:\n{consumer.tail()}"
            path = tmp_path / "handled.txt"
            return path.read_text().splitlines() if path.exists() else []

        wait_until(lambda: len(handled()) == 3, 60, what="3 messages handled")
        assert sorted(handled()) == ["hello 0", "hello 1", "hello 2"]
        assert consumer.terminate() == 0, consumer.tail()


def said(proc: Proc, text: str) -> list[tuple[float, str]]:
    """(time, message) of each record of the process's JSON log that holds ``text``."""
    found = []
    for line in proc.log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            if text in record["message"]:
                at = datetime.fromisoformat(record["time"]).timestamp()
                found.append((at, record["message"]))
    return found


def test_a_consumer_without_a_coordinator_says_so_within_seconds(
    settings: Settings, registry: Registry, stream: str, tmp_path: Path
) -> None:
    # Given a stream, a handler, and no coordinator for the stream
    spec, env = first_steps(settings, registry, stream, tmp_path)
    warning = "no coordinator leads stream"
    with started("consumer", consume_args(stream), env, tmp_path) as consumer:
        # When the consumer has joined its group
        (joined, _), *_ = wait_until(lambda: said(consumer, "joined "), 30, what="a join")
        # Then within NO_LEADER_WARNING seconds it says why nothing is assigned, and what to run
        (warned, line), *_ = wait_until(
            lambda: said(consumer, warning), NO_LEADER_WARNING + 30, what="the warning"
        )
        assert NO_LEADER_WARNING <= warned - joined <= NO_LEADER_WARNING + 2.0, warned - joined
        assert f"start one with `partq coordinator {stream}`" in line
        # When a coordinator starts
        with started("coordinator", coordinator_args(stream), env, tmp_path):
            # Then the consumer says once that one runs, consumes, and warns no more
            wait_until(lambda: said(consumer, "a coordinator now runs for"), 30, what="news")
            with Producer(spec, amqp_url=settings.amqp, name="partq-test-no-leader") as producer:
                producer.publish("k", "after the coordinator").result(10)
            handled = tmp_path / "handled.txt"
            wait_until(handled.exists, 60, what="the message handled")
            # a whole warning period more, in which a repeated warning would show
            wait_until(lambda: time.time() > warned + 2 * NO_LEADER_WARNING + 1, 30)
            assert consumer.terminate() == 0, consumer.tail()
    assert len(said(consumer, warning)) == 1, said(consumer, warning)
    assert len(said(consumer, "a coordinator now runs for")) == 1


def partq(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PARTQ), *args],
        capture_output=True,
        text=True,
        env=partq_env(settings),
        timeout=60,
        check=False,
    )


def test_adopting_a_parking_streams_queues_keeps_it_parking(
    settings: Settings, registry: Registry, stream: str
) -> None:
    # Given a stream created parking (the default), whose spec etcd then lost
    created = partq(settings, "stream", "create", stream, "--partitions", "3")
    assert created.returncode == 0, created.stderr
    assert registry.read_spec(stream).on_failure == "park"
    registry.client.delete(keys.spec(stream))

    # When its spec is restored from the queues, without and then with --on-failure
    adopted = partq(settings, "stream", "create", stream, "--adopt")

    # Then the stream parks again, and says so
    assert adopted.returncode == 0, adopted.stderr
    assert "adopted: 3 partitions, quorum queues, on failure park" in adopted.stdout
    assert registry.read_spec(stream) == StreamSpec(stream, 3, "quorum", on_failure="park")
    # And a stored spec's policy is kept, not silently changed
    changed = partq(settings, "stream", "create", stream, "--adopt", "--on-failure", "dead-letter")
    assert changed.returncode != 0
    assert "stored with --on-failure park, not dead-letter" in changed.stderr
    assert registry.read_spec(stream).on_failure == "park"


def test_adopt_takes_on_failure_for_a_stream_etcd_lost(
    settings: Settings, registry: Registry, stream: str
) -> None:
    # Given a dead-lettering stream whose spec etcd lost
    args = ["stream", "create", stream, "--partitions", "2", "--on-failure", "dead-letter"]
    assert partq(settings, *args).returncode == 0
    registry.client.delete(keys.spec(stream))
    # When it is adopted with --on-failure park (the operator's choice: nothing stored)
    adopted = partq(settings, "stream", "create", stream, "--adopt", "--on-failure", "park")
    # Then the flag is not ignored
    assert adopted.returncode == 0, adopted.stderr
    assert registry.read_spec(stream).on_failure == "park"
