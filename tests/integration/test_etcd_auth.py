"""etcd authentication that lasts: TLS with user/password (short-lived tokens), client
certificates (the CN is the etcd user), and one distinct line per way etcd refuses us.

Each test starts its own etcd on loopback with certificates made here with the
``openssl`` CLI, and ``--auth-token-ttl 2``: a token left unused for 2 s is
gone, so a client that survives a few idle spells here survives weeks of 300 s
tokens. Waits are bounded (``queue.get(timeout=…)``, fixed idle spells).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from partq.kernel.errors import (
    EtcdAuthFailed,
    EtcdPermissionDenied,
    EtcdTLSError,
    EtcdUnavailable,
    UsageError,
)
from partq.kernel.etcd import connect, etcd_errors
from partq.kernel.local import EtcdTLS, LocalEtcd, free_port
from partq.kernel.settings import Settings
from tests.pki import issue, make_ca

pytestmark = [pytest.mark.integration]

TTL = 2  # etcd --auth-token-ttl of these servers, seconds
IDLE = TTL * 2.5  # one idle spell: the token is certainly gone after it
ROOT_PASSWORD = "root-secret"
PARTQ_PASSWORD = "partq-secret"
EVENT_WAIT = 5.0


# -- certificates ----------------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    ca: Path  # signed the server's and the clients' certificates
    other_ca: Path  # a CA etcd does not know and that did not sign etcd's certificate
    server: tuple[Path, Path]  # cert, key: 127.0.0.1 and localhost
    root: tuple[Path, Path]  # client certificate, CN=root
    partq: tuple[Path, Path]  # client certificate, CN=partq
    stranger: tuple[Path, Path]  # CN=partq, but signed by other_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("pki")
    ca, _ = make_ca(d, "ca")
    other, _ = make_ca(d, "other-ca")
    return PKI(
        ca=ca,
        other_ca=other,
        server=issue(d, "ca", "server", "localhost", "IP:127.0.0.1,DNS:localhost"),
        root=issue(d, "ca", "root", "root", "DNS:root"),
        partq=issue(d, "ca", "partq", "partq", "DNS:partq"),
        stranger=issue(d, "other-ca", "stranger", "partq", "DNS:partq"),
    )


# -- servers ---------------------------------------------------------------------------


def _enable_auth(etcd: LocalEtcd, pki: PKI, *, partq_password: str | None) -> None:
    """root, a role ``partq`` with readwrite on /partq/, a user ``partq`` with it; enable."""
    admin: dict[str, Any] = {}
    if etcd.tls is not None and etcd.tls.client_cert_auth:
        admin = {"cert": pki.root[0], "key": pki.root[1]}
    etcd.etcdctl("user", "add", f"root:{ROOT_PASSWORD}", **admin)
    etcd.etcdctl("role", "add", "partq", **admin)
    etcd.etcdctl("role", "grant-permission", "partq", "--prefix=true", "readwrite", "/partq/",
                 **admin)  # fmt: skip
    if partq_password is None:
        etcd.etcdctl("user", "add", "partq", "--no-password", **admin)
    else:
        etcd.etcdctl("user", "add", f"partq:{partq_password}", **admin)
    etcd.etcdctl("user", "grant-role", "partq", "partq", **admin)
    etcd.etcdctl("auth", "enable", **admin)


@pytest.fixture(scope="module")
def password_etcd(pki: PKI) -> Iterator[LocalEtcd]:
    """TLS (server certificate only) + auth enabled + 2 s tokens."""
    server = LocalEtcd(tls=EtcdTLS(*pki.server, pki.ca), auth_token_ttl=TTL)
    try:
        server.start()
    except Exception as e:
        pytest.skip(f"etcd would not start: {e}")
    try:
        _enable_auth(server, pki, partq_password=PARTQ_PASSWORD)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cert_etcd(pki: PKI) -> Iterator[LocalEtcd]:
    """TLS + client certificates required (CN = user) + auth enabled + 2 s tokens."""
    server = LocalEtcd(tls=EtcdTLS(*pki.server, pki.ca, client_cert_auth=True),
                       auth_token_ttl=TTL)  # fmt: skip
    try:
        server.start()
    except Exception as e:
        pytest.skip(f"etcd would not start: {e}")
    try:
        _enable_auth(server, pki, partq_password=None)
        yield server
    finally:
        server.stop()


def _settings(etcd: LocalEtcd, pki: PKI, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"etcd_endpoints": etcd.endpoint, "etcd_ca": pki.ca}
    values.update(overrides)
    return Settings.load(**values)


def _as_partq(etcd: LocalEtcd, pki: PKI, password: str = PARTQ_PASSWORD) -> Settings:
    return _settings(etcd, pki, etcd_user="partq", etcd_password=password)


@pytest.fixture
def client(password_etcd: LocalEtcd, pki: PKI) -> Iterator[Any]:
    c = connect(_as_partq(password_etcd, pki))
    yield c
    c.close()


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


# -- the token expires; the client does not notice ---------------------------------------


def test_get_put_txn_and_leases_work_after_idle_spells(
    client: Any, password_etcd: LocalEtcd, pki: PKI
) -> None:
    # Given a password client, a lease, and a watch made while the token was fresh
    where = password_etcd.endpoint
    t = client.transactions
    key, other = "/partq/test/idle/key", "/partq/test/idle/other"
    lease = client.lease(60)
    events: queue.Queue[Any] = queue.Queue()
    client.add_watch_callback(key, events.put)
    for cycle in range(3):
        # When it stays idle longer than the token lives
        time.sleep(IDLE)
        # Then every kind of call still works (translated errors would fail the test)
        with etcd_errors(where):
            client.put(key, f"v{cycle}", lease=lease)
            value, _meta = client.get(key)
            assert value == f"v{cycle}".encode()
            ok, _ = client.transaction(
                compare=[t.value(key) == f"v{cycle}"], success=[t.put(other, str(cycle))],
                failure=[],
            )  # fmt: skip
            assert ok
            assert client.get_prefix("/partq/test/idle/")
            refreshed = lease.refresh()
            assert refreshed and refreshed[0].TTL > 0
            granted = client.lease(5)
            granted.revoke()
        # And the watch made before the idle spells still delivers
        response = events.get(timeout=EVENT_WAIT)
        assert [e.value for e in response.events] == [f"v{cycle}".encode()]


def test_watches_made_after_an_idle_spell_deliver(
    client: Any, password_etcd: LocalEtcd, pki: PKI
) -> None:
    # Given a password client that has been idle for longer than the token lives
    where = password_etcd.endpoint
    prefix = "/partq/test/late-watch/"
    client.put(f"{prefix}warm", "x")
    for cycle in range(2):
        time.sleep(IDLE)
        # When it makes a new prefix watch (as a coordinator or consumer does on resync)
        events: queue.Queue[Any] = queue.Queue()
        with etcd_errors(where):
            watch_id = client.add_watch_prefix_callback(prefix, events.put)
        # Then the watch delivers what another client writes
        with connect(_as_partq(password_etcd, pki)) as writer:
            writer.put(f"{prefix}k", f"v{cycle}")
        response = events.get(timeout=EVENT_WAIT)
        assert [e.value for e in response.events] == [f"v{cycle}".encode()]
        client.cancel_watch(watch_id)
    # And watch_once (a joining consumer waiting out its old member key) works too
    time.sleep(IDLE)
    with connect(_as_partq(password_etcd, pki)) as writer:
        timer = threading.Timer(1.0, writer.put, (f"{prefix}once", "done"))
        timer.start()
        try:
            with etcd_errors(where):
                event = client.watch_once(f"{prefix}once", timeout=EVENT_WAIT)
        finally:
            timer.join(EVENT_WAIT)
    assert event.value == b"done"


def test_a_password_change_does_not_strand_the_token(
    client: Any, password_etcd: LocalEtcd, pki: PKI
) -> None:
    # Given a connected password client, its token fresh
    where = password_etcd.endpoint
    with etcd_errors(where):
        client.put("/partq/test/passwd/k", "before")
    # When an administrator sets the user's password (to the same one): etcd drops its tokens
    password_etcd.etcdctl(
        "user", "passwd", "partq", "--interactive=false",
        user=f"root:{ROOT_PASSWORD}", stdin=f"{PARTQ_PASSWORD}\n",
    )  # fmt: skip
    # Then the client's next call still works: it authenticates again
    with etcd_errors(where):
        client.put("/partq/test/passwd/k", "after")
        assert client.get("/partq/test/passwd/k")[0] == b"after"


def test_auth_enabled_while_the_client_runs(pki: PKI, caplog: pytest.LogCaptureFixture) -> None:
    # Given a TLS etcd without authentication, and a client configured with a user
    server = LocalEtcd(tls=EtcdTLS(*pki.server, pki.ca), auth_token_ttl=TTL)
    server.start()
    try:
        with caplog.at_level("WARNING", logger="partq.etcd"):
            client = connect(_as_partq(server, pki))
        assert "authentication disabled" in caplog.text  # it says so, and works without
        try:
            with etcd_errors(server.endpoint):
                client.put("/partq/test/later/k", "open")
            # When an administrator enables authentication
            _enable_auth(server, pki, partq_password=PARTQ_PASSWORD)
            # Then the running client authenticates and goes on
            with etcd_errors(server.endpoint):
                client.put("/partq/test/later/k", "closed")
                assert client.get("/partq/test/later/k")[0] == b"closed"
        finally:
            client.close()
    finally:
        server.stop()


# -- refusals, each with its own line ---------------------------------------------------


def test_wrong_password_says_authentication_failed(password_etcd: LocalEtcd, pki: PKI) -> None:
    with pytest.raises(EtcdAuthFailed) as caught:
        connect(_as_partq(password_etcd, pki, password="not-the-password"))
    text = _one_line(caught.value)
    assert "authentication failed" in text
    assert "'partq'" in text and "PARTQ_ETCD_PASSWORD" in text
    assert "is it running" not in text
    assert "not-the-password" not in text


def test_no_credentials_against_an_auth_etcd_says_so(password_etcd: LocalEtcd, pki: PKI) -> None:
    client = connect(_settings(password_etcd, pki))  # status needs no user
    try:
        with pytest.raises(EtcdAuthFailed) as caught, etcd_errors(password_etcd.endpoint):
            client.get("/partq/test/anonymous")
        text = _one_line(caught.value)
        assert "requires authentication" in text and "--etcd-user" in text
    finally:
        client.close()


def test_untrusted_server_certificate_names_the_ca_file(password_etcd: LocalEtcd, pki: PKI) -> None:
    with pytest.raises(EtcdTLSError) as caught:
        connect(
            _settings(
                password_etcd,
                pki,
                etcd_ca=pki.other_ca,
                etcd_user="partq",
                etcd_password=PARTQ_PASSWORD,
            )
        )
    text = _one_line(caught.value)
    assert "server certificate" in text and "not trusted" in text
    assert str(pki.other_ca) in text
    assert "is it running" not in text


def test_password_over_plain_http_is_refused_with_a_tls_hint(
    password_etcd: LocalEtcd, pki: PKI, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    http = f"http://127.0.0.1:{password_etcd.port}"
    settings = Settings.load(etcd_endpoints=http, etcd_user="partq", etcd_password=PARTQ_PASSWORD)
    with pytest.raises(UsageError) as caught:
        connect(settings)
    text = _one_line(caught.value)
    assert "https://" in text and "--etcd-ca" in text and "TLS" in text
    # And the CLI exits with 2 and that one line
    from partq.cli import main

    for name in ("PARTQ_ETCD_CA", "PARTQ_ETCD_CERT", "PARTQ_ETCD_KEY", "PARTQ_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD", PARTQ_PASSWORD)
    code = main(["--etcd-endpoints", http, "--etcd-user", "partq", "stream", "list"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err and err[-1].startswith("partq: error: ") and "https://" in err[-1], err


def test_permission_denied_names_the_key(client: Any, password_etcd: LocalEtcd) -> None:
    where = password_etcd.endpoint
    t = client.transactions
    with pytest.raises(EtcdPermissionDenied) as caught, etcd_errors(where):
        client.put("/elsewhere/x", "1")
    text = _one_line(caught.value)
    assert "/elsewhere/x" in text and "'partq'" in text and "permission" in text
    with pytest.raises(EtcdPermissionDenied) as caught, etcd_errors(where):
        client.transaction(compare=[t.version("/elsewhere/y") == 0],
                           success=[t.put("/elsewhere/y", "1")], failure=[])  # fmt: skip
    assert "/elsewhere/y" in _one_line(caught.value)
    # A watch the user may not make is refused (python3-etcd3 returned watch id -1 and
    # never delivered anything)
    with pytest.raises(EtcdPermissionDenied) as caught, etcd_errors(where):
        client.add_watch_prefix_callback("/elsewhere/", lambda _r: None)
    assert "/elsewhere/" in _one_line(caught.value)


def test_unreachable_etcd_is_still_is_it_running(pki: PKI) -> None:
    settings = Settings.load(etcd_endpoints=f"https://127.0.0.1:{free_port()}", etcd_ca=pki.ca,
                             etcd_user="partq", etcd_password=PARTQ_PASSWORD)  # fmt: skip
    with pytest.raises(EtcdUnavailable) as caught:
        connect(settings)
    assert type(caught.value) is EtcdUnavailable
    assert "is it running" in _one_line(caught.value)


# -- client certificates: the CN is the user -------------------------------------------


def test_client_certificate_cn_is_the_user(cert_etcd: LocalEtcd, pki: PKI) -> None:
    # Given a client with partq's certificate (CN=partq) and no password
    settings = _settings(cert_etcd, pki, etcd_cert=pki.partq[0], etcd_key=pki.partq[1])
    client = connect(settings)
    try:
        with etcd_errors(cert_etcd.endpoint):
            client.put("/partq/test/cn/k", "1")
        # Then it is partq: allowed under /partq/ even after an idle spell, denied elsewhere
        time.sleep(IDLE)
        events: queue.Queue[Any] = queue.Queue()
        with etcd_errors(cert_etcd.endpoint):
            client.add_watch_prefix_callback("/partq/test/cn/", events.put)
            client.put("/partq/test/cn/k", "2")
            assert client.get("/partq/test/cn/k")[0] == b"2"
        assert [e.value for e in events.get(timeout=EVENT_WAIT).events] == [b"2"]
        with pytest.raises(EtcdPermissionDenied) as caught, etcd_errors(cert_etcd.endpoint):
            client.put("/elsewhere/cn", "1")
        text = _one_line(caught.value)
        assert "/elsewhere/cn" in text and "CN" in text
    finally:
        client.close()


def test_missing_client_certificate_says_one_is_required(cert_etcd: LocalEtcd, pki: PKI) -> None:
    with pytest.raises(EtcdTLSError) as caught:
        connect(_settings(cert_etcd, pki))
    text = _one_line(caught.value)
    assert "client certificate" in text and "--etcd-cert" in text
    assert "is it running" not in text


def test_refused_client_certificate_says_so(cert_etcd: LocalEtcd, pki: PKI) -> None:
    settings = _settings(cert_etcd, pki, etcd_cert=pki.stranger[0], etcd_key=pki.stranger[1])
    with pytest.raises(EtcdTLSError) as caught:
        connect(settings)
    text = _one_line(caught.value)
    assert "refused" in text and str(pki.stranger[0]) in text
    assert "is it running" not in text


# -- a real group: coordinator and consumers as processes ----------------------------------

# seconds without a membership change: 10 token lifetimes in CI (its time budget), 65 on
# demand (PARTQ_TEST_EVERY_FAULT=1), the length this test first ran with
GROUP_IDLE = 130.0 if os.environ.get("PARTQ_TEST_EVERY_FAULT") else 20.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_rebalances_after_idle_minutes(
    password_etcd: LocalEtcd,
    pki: PKI,
    rabbitmq: str,
    stream_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from partq.coordinator.ops import admin
    from partq.coordinator.store.group import Group
    from partq.producer import StreamSpec
    from partq.producer.registry import Registry

    from .groups.harness import Fleet, balanced, wait_until

    partitions = 6
    settings = _as_partq(password_etcd, pki)

    def registry() -> Registry:  # a fresh client each time: observing must not need the fix
        return Registry(connect(settings), password_etcd.endpoint)

    def settle(members: set[str], timeout: float = 30.0) -> None:
        observer = registry()
        try:
            group = Group(observer.client, observer.where, stream_name)
            wait_until(lambda: balanced(group, partitions, members), timeout,
                       what=f"balance over {sorted(members)}")  # fmt: skip
        except AssertionError:
            print(fleet.logs())
            raise
        finally:
            observer.client.close()

    setup = registry()
    admin.create_stream(setup, rabbitmq, StreamSpec(stream_name, partitions, "quorum"))
    monkeypatch.setenv("PARTQ_ETCD_CA", str(pki.ca))
    monkeypatch.setenv("PARTQ_ETCD_USER", "partq")
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD", PARTQ_PASSWORD)
    fleet = Fleet(stream_name, tmp_path, password_etcd.endpoint, rabbitmq, tmp_path / "rec.jsonl")
    try:
        # Given a coordinator and two consumers, balanced, on an etcd with 2 s tokens
        coordinator = fleet.coordinator()
        fleet.consumer("c1")
        c2 = fleet.consumer("c2")
        settle({"c1", "c2"})
        # When nothing changes for minutes (every token the daemons got is long dead)
        began = time.monotonic()
        time.sleep(GROUP_IDLE)
        assert all(p.alive() for p in fleet.procs), fleet.logs()
        # Then a consumer that joins gets its share, and one that leaves hands its share over
        fleet.consumer("c3")
        settle({"c1", "c2", "c3"})
        assert c2.terminate() == 0, fleet.logs()
        settle({"c1", "c3"})
        assert coordinator.alive(), fleet.logs()
        print(f"\nidle {GROUP_IDLE:.0f}s with {TTL}s tokens; join and leave rebalanced "
              f"{time.monotonic() - began - GROUP_IDLE:.1f}s after the idle spell")  # fmt: skip
    finally:
        fleet.close()
        setup.client.close()
        cleanup = registry()
        try:
            admin.delete(cleanup, rabbitmq, stream_name)
        except Exception as e:
            print(f"cleanup of {stream_name} failed: {e}")
        finally:
            cleanup.client.close()


def test_security_roles_apply_as_a_non_root_user_is_one_line(
    password_etcd: LocalEtcd,
    pki: PKI,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the etcd user partq, whose role may write /partq/ but not manage users
    from partq.cli import main

    for name in ("PARTQ_ETCD_CERT", "PARTQ_ETCD_KEY", "PARTQ_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD", PARTQ_PASSWORD)
    # When it applies a stream's roles
    servers = ["--etcd-endpoints", password_etcd.endpoint, "--etcd-ca", str(pki.ca)]
    code = main(
        [*servers, "--etcd-user", "partq", "security", "roles", "s", "--apply", "--no-rabbitmq"]
    )
    # Then exit 1 with one line saying etcd's root role is needed, and no grant to copy
    err = capsys.readouterr().err.splitlines()
    assert code == 1, err
    assert len(err) == 1 and err[0].startswith("partq: error: etcd at "), err
    assert "may not manage users and roles (needs etcd's root role)" in err[0]
    assert "grant-permission" not in err[0]
