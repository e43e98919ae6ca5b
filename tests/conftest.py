"""Fixtures that start real servers: a private etcd per session, the machine's RabbitMQ.

A server that cannot be had is a skip on a developer's machine and a failure
in CI (``CI`` set), so a green CI run always means the integration tiers ran.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from partq.producer.registry import Registry

from partq.kernel import logs
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.rabbit import MACHINE, TREE_40, Install, PrivateRabbit, tree_rabbit

DATA = Path(__file__).resolve().parent / "data"
# set (to anything), the tests kept out of CI's 30 minutes run too
EVERY_FAULT = "PARTQ_TEST_EVERY_FAULT"
AMQP_URL = os.environ.get("PARTQ_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def _unavailable(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI", pytrace=False)
    pytest.skip(f"{what} is not available here")


def _docker_available() -> bool:
    """True only where a Docker daemon answers (these machines have a client but no daemon)."""
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker

        client = docker.from_env(timeout=2)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


class _ContainerEtcd:
    """The same surface as LocalEtcd, backed by testcontainers (used where Docker runs)."""

    IMAGE = "quay.io/coreos/etcd:v3.5.17"

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer

        self.container = (
            DockerContainer(self.IMAGE)
            .with_command(
                "etcd --listen-client-urls http://0.0.0.0:2379 "
                "--advertise-client-urls http://127.0.0.1:2379"
            )
            .with_exposed_ports(2379)
        )

    def start(self) -> _ContainerEtcd:
        self.container.start()
        return self

    @property
    def endpoint(self) -> str:
        host = self.container.get_container_host_ip()
        return f"http://{host}:{self.container.get_exposed_port(2379)}"

    def stop(self) -> None:
        self.container.stop()


@pytest.fixture(autouse=True)
def _partq_log_handler_removed() -> Iterator[None]:
    """partq's log handler, if a test installed it (a CLI run in-process: ``partq.kernel.logs.
    configure``), removed once the test ends: its stream is the one pytest captured for
    that test, closed then, and a later test's log line would print a "Logging error"."""
    before = set(logging.getLogger().handlers)
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h not in before]:
        if handler.get_name() == logs.HANDLER_NAME:
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def partition_vectors() -> dict[str, Any]:
    path = DATA / "partition-vectors.json"
    if not path.is_file():
        pytest.fail(f"golden vectors missing: {path} (they are part of the repository)")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[LocalEtcd]:
    """A private etcd: in a container where a Docker daemon runs, else Debian's binary
    on a free loopback port with a temporary data dir. Fault tests that stop etcd use
    their own LocalEtcd."""
    try:
        server: Any = _ContainerEtcd().start() if _docker_available() else LocalEtcd().start()
    except Exception as e:  # not installed, or it would not start
        _unavailable(f"etcd ({e})")
        raise
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rabbitmq(request: pytest.FixtureRequest) -> str:
    """The machine's RabbitMQ; with PARTQ_TEST_RABBITMQ=4.0.5 a private 4.0.5 node for
    the whole run (CI runs the invariant suite on both: tests/integration/groups)."""
    if os.environ.get("PARTQ_TEST_RABBITMQ") == "4.0.5":
        return str(request.getfixturevalue("rabbitmq_40"))
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            pass
    except OSError:
        _unavailable("RabbitMQ on 127.0.0.1:5672")
    return AMQP_URL


@pytest.fixture(scope="session")
def rabbit_install() -> Install:
    """The RabbitMQ that tests starting private nodes (TLS, least privilege, clusters) use:
    the machine's, or 4.0.5 from the trixie tree with PARTQ_TEST_RABBITMQ=4.0.5."""
    install = TREE_40 if os.environ.get("PARTQ_TEST_RABBITMQ") == "4.0.5" else MACHINE
    if not install.available():
        _unavailable(f"RabbitMQ's scripts ({install.root})")
    return install


@pytest.fixture(scope="session")
def rabbit_40_node() -> Iterator[PrivateRabbit]:
    """A private RabbitMQ 4.0.5 node (tests/rabbit.py: tree_rabbit), one per session."""
    node = tree_rabbit().start()
    try:
        with pika.BlockingConnection(pika.URLParameters(node.url)) as connection:
            version = connection._impl.server_properties["version"]
        assert str(version).startswith("4.0."), f"the tree's node is RabbitMQ {version}"
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def rabbitmq_40(rabbit_40_node: PrivateRabbit) -> str:
    return rabbit_40_node.url


Ctl = Callable[..., str]


@pytest.fixture(scope="session")
def rabbitmqctl(request: pytest.FixtureRequest) -> Ctl:
    """``ctl(*args, timeout=60) -> stdout``: rabbitmqctl for the broker of the run (the
    machine's, or the 4.0 node's with PARTQ_TEST_RABBITMQ=4.0.5)."""
    if os.environ.get("PARTQ_TEST_RABBITMQ") == "4.0.5":
        node: PrivateRabbit = request.getfixturevalue("rabbit_40_node")
        return node.ctl
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("needs the machine's rabbitmqctl")

    def ctl(*args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            ["rabbitmqctl", *args], capture_output=True, text=True, timeout=timeout, check=True
        )
        return done.stdout

    return ctl


@pytest.fixture
def settings(etcd_server: LocalEtcd, rabbitmq: str) -> Settings:
    return Settings.load(etcd_endpoints=etcd_server.endpoint, amqp_url=rabbitmq)


@pytest.fixture
def registry(settings: Settings) -> Iterator[Registry]:
    registry = Registry.connect(settings)
    yield registry
    registry.close()


@pytest.fixture
def stream_name(request: pytest.FixtureRequest) -> str:
    """A stream name no other test uses."""
    base = request.node.name.lower().replace("[", "-").replace("]", "")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in base)[:40]
    return f"t-{safe}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def vhost(rabbitmq: str, rabbitmqctl: Ctl) -> Iterator[str]:
    """The run's RabbitMQ URL on a virtual host of its own: README's commands name the
    stream ``orders``, a name other runs on this broker may use too."""
    name = f"partq-readme-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    parts = urllib.parse.urlsplit(rabbitmq)
    try:
        yield urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(name, "")))
    finally:
        rabbitmqctl("delete_vhost", name)
