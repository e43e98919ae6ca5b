"""RabbitMQ over TLS, with one distinct line per way RabbitMQ refuses us (issue 9).

Each module runs a PRIVATE RabbitMQ node on loopback (its own ports, epmd, data and
cookie; tests/rabbit.py), with certificates made here with the ``openssl`` CLI. The
server certificate names ``localhost`` only, so ``amqps://…@localhost`` verifies and
``amqps://…@127.0.0.1`` is a hostname mismatch. The machine's broker is not touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from partq.coordinator.ops import admin, dlq
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry

from partq.kernel.amqp import AmqpTarget, AmqpTLS, blocking_connection, connect_blocking
from partq.kernel.errors import BrokerUnavailable, StreamNotFound
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.pki import issue, make_ca
from tests.rabbit import Install, PrivateRabbit

pytestmark = [pytest.mark.integration]

PARTQ = str(Path(sys.executable).with_name("partq"))
USER = "partq"
PASSWORD = "p@ss:w/o?r#d%x Zq7"  # every character a URL cares about
LIMITED = "limited"  # a user with no permissions on the virtual host "/"


@dataclass(frozen=True)
class PKI:
    ca: Path
    other_ca: Path  # signed nothing the broker shows
    server: tuple[Path, Path]  # DNS:localhost only
    client: tuple[Path, Path]  # CN=partq, signed by ca
    stranger: tuple[Path, Path]  # CN=partq, signed by other_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("amqp-pki")
    ca, _ = make_ca(d, "ca")
    other, _ = make_ca(d, "other-ca")
    return PKI(
        ca=ca,
        other_ca=other,
        server=issue(d, "ca", "server", "localhost", "DNS:localhost"),
        client=issue(d, "ca", "client", "partq", "DNS:partq"),
        stranger=issue(d, "other-ca", "stranger", "partq", "DNS:partq"),
    )


def _node(
    tmp_path_factory: pytest.TempPathFactory, pki: PKI, install: Install, *, require_cert: bool
) -> Iterator[PrivateRabbit]:
    node = PrivateRabbit(
        tmp_path_factory.mktemp("rabbit"),
        *pki.server,
        pki.ca,
        fail_if_no_peer_cert=require_cert,
        name=f"partqtls{uuid.uuid4().hex[:6]}",
        # EXTERNAL: the client certificate's CN is the RabbitMQ user
        plugins=("rabbitmq_auth_mechanism_ssl",) if require_cert else (),
        extra_config="ssl_cert_login_from = common_name\n" if require_cert else "",
        install=install,
    )
    try:
        node.start()
    except Exception as e:
        pytest.skip(f"a private RabbitMQ would not start: {e}")
    try:
        node.ctl("add_user", USER, PASSWORD)
        node.ctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")
        node.ctl("add_user", LIMITED, "limited-pw")
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def broker(
    tmp_path_factory: pytest.TempPathFactory, pki: PKI, rabbit_install: Install
) -> Iterator[PrivateRabbit]:
    """TLS with client certificates verified when given, not required."""
    yield from _node(tmp_path_factory, pki, rabbit_install, require_cert=False)


@pytest.fixture(scope="module")
def strict_broker(
    tmp_path_factory: pytest.TempPathFactory, pki: PKI, rabbit_install: Install
) -> Iterator[PrivateRabbit]:
    """TLS with a client certificate required (fail_if_no_peer_cert = true)."""
    yield from _node(tmp_path_factory, pki, rabbit_install, require_cert=True)


def _url(node: PrivateRabbit, host: str = "localhost", user: str = USER) -> str:
    from urllib.parse import quote

    return f"amqps://{user}:{quote(PASSWORD, safe='')}@{host}:{node.tls_port}/%2F"


def _refusal(where: AmqpTarget) -> str:
    with pytest.raises(BrokerUnavailable) as caught:
        connect_blocking(where, name="partq-test").close()
    message = str(caught.value)
    assert "\n" not in message
    assert PASSWORD not in message and "Zq7" not in message
    return message


# -- connecting ---------------------------------------------------------------------------


def test_connects_with_ca_cert_and_key_settings(broker: PrivateRabbit, pki: PKI) -> None:
    # Given amqps:// with the CA, a client certificate and key as settings
    settings = Settings.load(
        amqp_url=_url(broker), amqp_ca=pki.ca, amqp_cert=pki.client[0], amqp_key=pki.client[1]
    )
    # When a connection is made with them, Then it opens over TLS
    with blocking_connection(settings.amqp) as connection:
        channel = connection.channel()
        channel.queue_declare("", exclusive=True)
        assert connection.is_open


def test_a_password_file_with_awkward_characters_logs_in(
    broker: PrivateRabbit, pki: PKI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the password (with @ : / ? # % and a space) in a Secret-mount-like file
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    for name in [n for n in os.environ if n.startswith("PARTQ_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PARTQ_AMQP_URL", f"amqps://{USER}@localhost:{broker.tls_port}/%2F")
    monkeypatch.setenv("PARTQ_AMQP_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("PARTQ_AMQP_CA", str(pki.ca))
    # When the settings are loaded and a connection made, Then RabbitMQ accepts it
    with blocking_connection(Settings.load().amqp) as connection:
        assert connection.is_open


def test_an_untrusted_server_certificate_names_the_ca_file(broker: PrivateRabbit, pki: PKI) -> None:
    message = _refusal(AmqpTarget(_url(broker), AmqpTLS(ca=pki.other_ca)))
    assert "server certificate is not trusted" in message
    assert str(pki.other_ca) in message


def test_without_a_ca_file_the_system_store_is_named(broker: PrivateRabbit) -> None:
    message = _refusal(AmqpTarget(_url(broker)))
    assert "not trusted by the system store" in message
    assert "PARTQ_AMQP_CA" in message


def test_a_hostname_mismatch_says_so(broker: PrivateRabbit, pki: PKI) -> None:
    # Given a server certificate for localhost only, and a URL with 127.0.0.1
    message = _refusal(AmqpTarget(_url(broker, host="127.0.0.1"), AmqpTLS(ca=pki.ca)))
    assert "does not name the host '127.0.0.1'" in message
    assert "not trusted" not in message


def test_a_wrong_password_says_authentication_failed(broker: PrivateRabbit, pki: PKI) -> None:
    url = f"amqps://{USER}:wrong-Zq7@localhost:{broker.tls_port}/%2F"
    message = _refusal(AmqpTarget(url, AmqpTLS(ca=pki.ca)))
    assert "authentication failed" in message
    assert "is it running" not in message


def test_no_permission_on_the_vhost_names_it(broker: PrivateRabbit, pki: PKI) -> None:
    url = f"amqps://{LIMITED}:limited-pw@localhost:{broker.tls_port}/%2F"
    with pytest.raises(BrokerUnavailable) as caught:
        connect_blocking(AmqpTarget(url, AmqpTLS(ca=pki.ca))).close()
    assert "permission denied on the virtual host '/'" in str(caught.value)


def test_no_permission_on_a_queue_names_it(broker: PrivateRabbit, pki: PKI) -> None:
    # Given a user allowed only queues named "mine.*"
    broker.ctl("set_permissions", "-p", "/", LIMITED, "^mine\\..*", "^mine\\..*", "^mine\\..*")
    try:
        url = f"amqps://{LIMITED}:limited-pw@localhost:{broker.tls_port}/%2F"
        # When it declares another queue, Then the error says permission denied and names it
        with (
            pytest.raises(BrokerUnavailable, match="permission denied") as caught,
            blocking_connection(AmqpTarget(url, AmqpTLS(ca=pki.ca))) as connection,
        ):
            connection.channel().queue_declare("theirs.q")
        message = str(caught.value)
        # 3.10 does not say which permission was missing ("use"); 4.0 does ("configure")
        assert re.search(f"user '{LIMITED}' may not (use|configure) queue 'theirs.q'", message)
        assert f"rabbitmqctl set_permissions -p / {LIMITED}" in message, message
    finally:
        broker.ctl("clear_permissions", "-p", "/", LIMITED)


def test_a_required_client_certificate_missing_says_so(
    strict_broker: PrivateRabbit, pki: PKI
) -> None:
    message = _refusal(AmqpTarget(_url(strict_broker), AmqpTLS(ca=pki.ca)))
    assert "requires a client certificate" in message
    assert "PARTQ_AMQP_CERT" in message


def test_a_refused_client_certificate_says_so(strict_broker: PrivateRabbit, pki: PKI) -> None:
    tls = AmqpTLS(ca=pki.ca, cert=pki.stranger[0], key=pki.stranger[1])
    message = _refusal(AmqpTarget(_url(strict_broker), tls))
    assert f"refused the client certificate {pki.stranger[0]}" in message


def test_a_client_certificate_gets_in_where_one_is_required(
    strict_broker: PrivateRabbit, pki: PKI
) -> None:
    tls = AmqpTLS(ca=pki.ca, cert=pki.client[0], key=pki.client[1])
    with blocking_connection(AmqpTarget(_url(strict_broker), tls)) as connection:
        assert connection.is_open


def _external(node: PrivateRabbit, pki: PKI) -> Settings:
    """Settings that log in with the client certificate (CN=partq) and no password."""
    return Settings.load(
        amqp_url=f"amqps://localhost:{node.tls_port}/%2F",
        amqp_ca=pki.ca,
        amqp_cert=pki.client[0],
        amqp_key=pki.client[1],
        amqp_external_auth=True,
    )


def test_external_auth_logs_in_as_the_certificates_cn(
    strict_broker: PrivateRabbit, pki: PKI
) -> None:
    # Given no password in the URL, a client certificate with CN=partq, and EXTERNAL auth
    settings = _external(strict_broker, pki)
    # When a connection is made, Then RabbitMQ takes the certificate's CN as the user
    with blocking_connection(settings.amqp) as connection:
        connection.channel().queue_declare("", exclusive=True)
        users = strict_broker.ctl("list_connections", "user", "auth_mechanism", "--quiet")
    assert users.split()[-2:] == [USER, "EXTERNAL"]  # after the header line


def test_partq_dlq_signs_its_requests_with_the_certificates_user(
    strict_broker: PrivateRabbit, pki: PKI
) -> None:
    # Given a certificate login (EXTERNAL: the URL names no user)
    settings = _external(strict_broker, pki)
    with blocking_connection(settings.amqp) as connection:
        channel = connection.channel()
        channel.exchange_declare("partq.who", durable=False)
        # When partq dlq asks who it is, Then it learns the CN RabbitMQ logged it in as
        assert dlq.sender(connection, "partq.who") == USER
        connection.channel().exchange_delete("partq.who")


def test_an_unreachable_broker_is_still_is_it_running(pki: PKI) -> None:
    from partq.kernel.local import free_port

    url = f"amqps://{USER}:x-Zq7@localhost:{free_port()}/%2F"
    assert "is it running?" in _refusal(AmqpTarget(url, AmqpTLS(ca=pki.ca)))


# -- end to end -------------------------------------------------------------------------


def _env(etcd: LocalEtcd, **extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
    environ["PARTQ_ETCD_ENDPOINTS"] = etcd.endpoint
    environ.update(extra)
    return environ


def _partq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PARTQ, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_stream_create_and_a_producer_publish_over_tls(
    etcd_server: LocalEtcd, broker: PrivateRabbit, pki: PKI, tmp_path: Path
) -> None:
    # Given TLS settings and the password from a file, as a Kubernetes pod would have them
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    env = _env(
        etcd_server,
        PARTQ_AMQP_URL=f"amqps://{USER}@localhost:{broker.tls_port}/%2F",
        PARTQ_AMQP_PASSWORD_FILE=str(secret),
        PARTQ_AMQP_CA=str(pki.ca),
        PARTQ_AMQP_CERT=str(pki.client[0]),
        PARTQ_AMQP_KEY=str(pki.client[1]),
    )
    name = f"tls-{uuid.uuid4().hex[:8]}"
    settings = Settings.load(
        etcd_endpoints=etcd_server.endpoint,
        amqp_url=f"amqps://{USER}@localhost:{broker.tls_port}/%2F",
        amqp_password_file=secret,
        amqp_ca=pki.ca,
        amqp_cert=pki.client[0],
        amqp_key=pki.client[1],
    )
    registry = Registry.connect(settings)
    try:
        # When `partq stream create` runs over TLS
        done = _partq(env, "stream", "create", name, "--partitions", "2")
        assert done.returncode == 0, done.stderr
        assert "created" in done.stdout
        # and a producer publishes a message over TLS
        with Producer(name, amqp_url=settings.amqp, etcd=registry) as producer:
            producer.publish("k", b"over tls").result(timeout=10)
        # Then the message is in its partition queue
        spec = registry.read_spec(name)
        with blocking_connection(settings.amqp) as connection:
            channel = connection.channel()
            counts = [
                channel.queue_declare(spec.queue(p), passive=True).method.message_count
                for p in range(spec.partitions)
            ]
        assert sum(counts) == 1
    finally:
        with contextlib.suppress(StreamNotFound, BrokerUnavailable):
            admin.delete(registry, settings.amqp, name)
        registry.close()


def test_a_failing_cli_call_prints_no_secret(
    etcd_server: LocalEtcd, broker: PrivateRabbit, pki: PKI, tmp_path: Path
) -> None:
    # Given a wrong password, once in PARTQ_AMQP_URL and once in --amqp-url
    wrong = "wr@ng/pw?Zq7"
    from urllib.parse import quote

    url = f"amqps://{USER}:{quote(wrong, safe='')}@localhost:{broker.tls_port}/%2F"
    for how, given, args in [
        ("env", {"PARTQ_AMQP_URL": url}, ()),
        ("argv", {}, ("--amqp-url", url)),
    ]:
        env = _env(etcd_server, PARTQ_AMQP_CA=str(pki.ca), **given)
        # When a command fails against RabbitMQ
        done = _partq(env, *args, "stream", "create", f"tls-{uuid.uuid4().hex[:8]}",
                      "--partitions", "1")  # fmt: skip
        # Then it says authentication failed, without the password, encoded or not
        assert done.returncode == 1, (how, done.stderr)
        assert "authentication failed" in done.stderr, (how, done.stderr)
        for text in (wrong, quote(wrong, safe=""), "Zq7"):
            assert text not in done.stdout + done.stderr, (how, done.stderr)
        warned = "visible" in done.stderr or "`ps`" in done.stderr
        assert warned == (how == "argv"), (how, done.stderr)


def test_a_consumer_refused_its_queue_names_it_and_exits_6(
    etcd_server: LocalEtcd, broker: PrivateRabbit, pki: PKI, tmp_path: Path
) -> None:
    # Given a stream, its coordinator, and a user that may do anything but read its queues
    name = f"refused-{uuid.uuid4().hex[:8]}"
    user, password = f"noread-{uuid.uuid4().hex[:6]}", "noread-pw-Zq7"
    broker.ctl("add_user", user, password)
    not_partitions = f"^(?!partq\\.{name}\\.p[0-9]).*"
    broker.ctl("set_permissions", "-p", "/", user, ".*", ".*", not_partitions)
    settings = Settings.load(
        etcd_endpoints=etcd_server.endpoint, amqp_url=_url(broker), amqp_ca=pki.ca
    )
    registry = Registry.connect(settings)
    admin.create_stream(registry, settings.amqp, StreamSpec(name, 2, "quorum"))
    tls = {"PARTQ_AMQP_CA": str(pki.ca)}
    logs = {who: tmp_path / f"{who}.log" for who in ("coordinator", "consumer")}
    procs: list[subprocess.Popen[bytes]] = []

    def start(who: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        with logs[who].open("wb") as out:
            proc = subprocess.Popen([PARTQ, *args, "--http-port", "0"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        procs.append(proc)
        return proc

    try:
        start("coordinator", _env(etcd_server, PARTQ_AMQP_URL=_url(broker), **tls),
              "coordinator", name, "--settle", "0.3", "--ttl", "2")  # fmt: skip
        url = f"amqps://{user}:{password}@localhost:{broker.tls_port}/%2F"
        # When the consumer is assigned the partitions and subscribes
        env = _env(etcd_server, PARTQ_AMQP_URL=url, **tls)
        consumer = start("consumer", env, "consume", name, "--member-id", "refused-1",
                         "--handler", "examples.handlers:noop_handler", "--ttl", "2",
                         "--drain-timeout", "5")  # fmt: skip
        # Then it exits 6, having said which queue, which user and what to grant
        code = consumer.wait(timeout=90)
        log = logs["consumer"].read_text()
        assert code == 6, log
        refusals = [line for line in log.splitlines() if "permission denied" in line]
        assert 1 <= len(refusals) <= 2, log  # one per partition at most: no retry loop
        assert f"user '{user}' may not read queue 'partq.{name}.p0000" in refusals[0], log
        assert f"rabbitmqctl set_permissions -p / {user}" in refusals[0], log
        assert "exiting with code 6" in log and "Traceback" not in log, log
        assert password not in log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)
        with contextlib.suppress(StreamNotFound, BrokerUnavailable):
            admin.delete(registry, settings.amqp, name)
        registry.close()
        broker.ctl("delete_user", user)
