"""A new user's first steps, as processes against a real etcd and RabbitMQ: a handler in
the folder they run ``partq consume`` from, adopting a parking stream's queues."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import admin
from kernel import keys
from kernel.settings import Settings
from producer import Producer, StreamNotFound, StreamSpec
from producer.registry import Registry
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


def test_a_handler_module_in_the_working_directory_is_found(
    settings: Settings, registry: Registry, stream: str, tmp_path: Path
) -> None:
    # Given myhandlers.py in the folder the user works in, and a stream with a coordinator
    (tmp_path / "myhandlers.py").write_text(FIRST_HANDLER)
    spec = StreamSpec(stream, 2, "quorum")
    admin.create_stream(registry, settings.amqp, spec)
    env = partq_env(settings)
    coordinator = ["coordinator", stream, "--settle", "0.5", "--http-port", "0"]
    # When `partq consume --handler myhandlers:handle` runs from that folder
    consume = ["consume", stream, "--handler", "myhandlers:handle", "--http-port", "0"]
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
