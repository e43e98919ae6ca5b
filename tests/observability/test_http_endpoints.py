"""The daemons' HTTP endpoints under load and under failure (real etcd and RabbitMQ).

The measured bugs: every GET of ``/`` or ``/metrics`` opened an AMQP connection; an
etcd error printed a traceback instead of a page; a second ``partq consume`` on the
same port died with a traceback.

AMQP connections are counted where they are made: the coordinator runs under a
prelude that records every ``socket.connect`` to the broker's port, so other users of
the shared broker do not disturb the count.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamSpec
from partq.producer.registry import Registry
from partq.producer.topology import delete_stream

from partq.kernel.amqp import blocking_connection
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

from .conftest import HANDLER, PARTQ, ROOT, Launcher, Proc, free_port, http_get, wait_until

pytestmark = [pytest.mark.integration]

# Runs `partq ARGS` with every TCP connect to the AMQP port appended to $PARTQ_TEST_CONNECTS.
PRELUDE = """
import os, socket, sys
_log, _port = os.environ["PARTQ_TEST_CONNECTS"], int(os.environ["PARTQ_TEST_AMQP_PORT"])
_connect = socket.socket.connect
def connect(self, address):
    if isinstance(address, tuple) and len(address) >= 2 and address[1] == _port:
        with open(_log, "a") as f:
            f.write(repr(address) + "\\n")
    return _connect(self, address)
socket.socket.connect = connect
from partq.cli import main
sys.exit(main(sys.argv[1:]))
"""


def counted_coordinator(
    launcher: Launcher, monkeypatch: pytest.MonkeyPatch, stream: str, connects: Path
) -> Proc:
    port = free_port()
    monkeypatch.setenv("PARTQ_TEST_CONNECTS", str(connects))
    amqp_port = urllib.parse.urlsplit(launcher.amqp).port or 5672
    monkeypatch.setenv("PARTQ_TEST_AMQP_PORT", str(amqp_port))
    argv = [sys.executable, "-c", PRELUDE, "coordinator", stream, "--settle", "0.3", "--ttl", "2"]
    argv += ["--http-host", "127.0.0.1", "--http-port", str(port)]
    return launcher.start("coordinator", argv, port)


def connections(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def leading(proc: Proc, stream: str) -> bool:
    status, body = http_get(proc.base + "/metrics")
    return status == 200 and f'partq_coordinator_is_leader{{stream="{stream}"}} 1.0' in (
        body.decode()
    )


def test_200_scrapes_and_page_loads_share_one_amqp_connection(
    launcher: Launcher, make_stream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a leading coordinator (it exports queue depths) of an 8-partition stream
    spec = make_stream(8)
    connects = tmp_path / "connects.txt"
    coordinator = counted_coordinator(launcher, monkeypatch, spec.name, connects)
    launcher.wait_ready(coordinator)
    wait_until(lambda: leading(coordinator, spec.name), 20, what="the coordinator leads")
    # When /metrics and the status page are fetched 100 times each
    for _ in range(100):
        metrics = http_get(coordinator.base + "/metrics")
        page = http_get(coordinator.base + "/")
        assert metrics[0] == 200 and page[0] == 200, (metrics[0], page[0], launcher.logs())
    # Then the depths are there, and at most a couple of AMQP connections were opened
    assert f'partq_queue_messages{{partition="0",queue="{spec.queue(0)}"' in metrics[1].decode()
    assert spec.queue(7) in page[1].decode()
    opened = connections(connects)
    assert 1 <= opened <= 2, f"{opened} AMQP connections for 200 GETs"
    assert "Traceback" not in coordinator.tail(200)


@pytest.fixture
def private_etcd() -> Iterator[LocalEtcd]:
    """An etcd this test stops (stop() is by the PID it started)."""
    etcd = LocalEtcd().start()
    try:
        yield etcd
    finally:
        etcd.stop()


def test_etcd_stopped_gives_503_with_a_one_line_reason(
    tmp_path: Path, private_etcd: LocalEtcd, rabbitmq: str, stream_name: str
) -> None:
    # Given a coordinator of a stream kept in a private etcd, serving its page
    registry = Registry.connect(Settings.load(etcd_endpoints=private_etcd.endpoint))
    spec = StreamSpec(stream_name, 2, "quorum")
    admin.create_stream(registry, rabbitmq, spec)
    fleet = Launcher(tmp_path, private_etcd.endpoint, rabbitmq)
    try:
        coordinator = fleet.coordinator(spec.name)
        fleet.wait_ready(coordinator)
        assert http_get(coordinator.base + "/")[0] == 200
        # When etcd stops
        private_etcd.stop()
        # Then /readyz and / answer 503 with one line naming etcd, and no traceback
        wait_until(lambda: http_get(coordinator.base + "/readyz")[0] == 503, 20, what="/readyz 503")
        for path in ("/readyz", "/"):
            status, body = http_get(coordinator.base + path)
            text = body.decode()
            assert status == 503, (path, status, text)
            assert len(text.strip().splitlines()) == 1, (path, text)
            assert "etcd" in text and "Traceback" not in text, (path, text)
        # And /livez and /metrics still answer
        assert http_get(coordinator.base + "/livez")[0] == 200
        assert http_get(coordinator.base + "/metrics")[0] == 200
        assert coordinator.alive()
        log = coordinator.tail(400)
        assert "Traceback" not in log, log
    finally:
        fleet.close()
        registry.close()
        with blocking_connection(rabbitmq) as connection:
            delete_stream(connection, spec)


def run_partq(launcher: Launcher, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
    env.update({"PARTQ_ETCD_ENDPOINTS": launcher.etcd, "PARTQ_AMQP_URL": launcher.amqp})
    return subprocess.run(
        [str(PARTQ), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("daemon", ["consume", "coordinator"])
def test_port_in_use_is_a_one_line_error_exit_2(
    launcher: Launcher, make_stream: Any, daemon: str
) -> None:
    # Given a port something already listens on
    spec = make_stream(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # When a daemon is started on it
        extra = ["--handler", HANDLER, "--member-id", "m1"] if daemon == "consume" else []
        http = ["--http-host", "127.0.0.1", "--http-port", str(port)]
        result = run_partq(launcher, daemon, spec.name, *extra, *http)
    # Then it exits 2 with one line naming the port and the flags that fix it
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("partq:")]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port} is already in use" in lines[0], lines[0]
    assert "--http-port" in lines[0] and "--http-port 0" in lines[0], lines[0]


def test_http_port_0_picks_a_free_port_and_logs_it(launcher: Launcher, make_stream: Any) -> None:
    # Given a stream
    spec = make_stream(2)
    # When a consumer starts with --http-port 0
    argv = [str(PARTQ), "consume", spec.name, "--handler", HANDLER, "--member-id", "zero"]
    argv += ["--ttl", "2", "--drain-timeout", "5", "--http-host", "127.0.0.1", "--http-port", "0"]
    proc = launcher.start("zero", argv, 0)

    def logged_port() -> int | None:
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", proc.tail(50))
        return int(match.group(1)) if match else None

    # Then it logs the port it got, and serves /readyz there
    port = wait_until(logged_port, 20, what="the chosen port in the log")
    assert port != 0
    proc.port = port
    launcher.wait_ready(proc)
    assert proc.terminate(timeout=20) == 0, proc.tail()
