"""partq.kernel.etcd at the edge, without a server: each way etcd refuses us gets its own
one-line error, and a password is never sent over plain http.

The gRPC details below are the ones measured against etcd 3.4.23 and grpcio 1.85
(tests/integration/test_etcd_auth.py provokes them for real).
"""

from __future__ import annotations

from pathlib import Path

import etcd3.exceptions
import grpc
import pytest

from partq.kernel.errors import (
    BrokerUnavailable,
    EtcdAuthFailed,
    EtcdCompacted,
    EtcdError,
    EtcdPermissionDenied,
    EtcdRefused,
    EtcdTLSError,
    EtcdUnavailable,
    MalformedValue,
    NotLeader,
    UsageError,
    retryable,
)
from partq.kernel.etcd import CallFailed, Identity, _cancel_status, connect, translate
from partq.kernel.settings import Settings

WHERE = "https://etcd.example:2379"
PASSWORD_USER = Identity(user="partq", ca="/etc/partq/ca.pem")
CERT_USER = Identity(ca="/etc/partq/ca.pem", cert="/etc/partq/partq.pem")
TLS_ONLY = Identity(ca="/etc/partq/ca.pem")
Code = grpc.StatusCode


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PARTQ_ETCD_* variable of the developer's shell leaks into Settings here."""
    for name in ("ENDPOINTS", "USER", "PASSWORD", "CA", "CERT", "KEY", "TIMEOUT"):
        monkeypatch.delenv(f"PARTQ_ETCD_{name}", raising=False)


def failed(code: grpc.StatusCode, details: str, who: Identity = PASSWORD_USER, **kw: str) -> str:
    error = translate(CallFailed(code, details, who, **kw), WHERE)
    text = str(error)
    assert "\n" not in text
    return f"{type(error).__name__}: {text}"


def test_wrong_password() -> None:
    text = failed(
        Code.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password"
    )
    assert text.startswith("EtcdAuthFailed: ")
    assert "authentication failed for user 'partq'" in text and "PARTQ_ETCD_PASSWORD" in text


def test_no_credentials_where_etcd_wants_them() -> None:
    text = failed(Code.INVALID_ARGUMENT, "etcdserver: user name is empty", TLS_ONLY)
    assert text.startswith("EtcdAuthFailed: ") and "requires authentication" in text
    # a certificate was sent, but this etcd does not take users from certificates
    text = failed(Code.INVALID_ARGUMENT, "etcdserver: user name is empty", CERT_USER)
    assert "--client-cert-auth" in text and "/etc/partq/partq.pem" in text


def test_permission_denied_names_who_what_and_the_key() -> None:
    text = failed(Code.PERMISSION_DENIED, "etcdserver: permission denied", op="write",
                  key="/partq/v1/streams/s/spec")  # fmt: skip
    assert text.startswith("EtcdPermissionDenied: ")
    assert "etcd user 'partq' may not write /partq/v1/streams/s/spec" in text
    text = failed(Code.PERMISSION_DENIED, "etcdserver: permission denied", CERT_USER,
                  op="watch", key="/partq/v1/streams/s/*")  # fmt: skip
    assert "CN of /etc/partq/partq.pem may not watch /partq/v1/streams/s/*" in text


def test_server_certificate_not_trusted_names_the_ca_file() -> None:
    details = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: Tls "
        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
        "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK"
    )
    text = failed(Code.UNAVAILABLE, details)
    assert text.startswith("EtcdTLSError: ")
    assert "not trusted by the CA file /etc/partq/ca.pem" in text
    assert text.endswith("unable to get local issuer certificate")


def test_server_certificate_for_another_host() -> None:
    details = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: Custom "
        "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check "
        "failed."
    )
    text = failed(Code.UNAVAILABLE, details)
    assert text.startswith("EtcdTLSError: ") and "does not name the host" in text


def test_client_certificate_required_or_refused() -> None:
    details = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:2379: "
        "Unwrap failed (TSI_DATA_CORRUPTED)"
    )
    text = failed(Code.UNAVAILABLE, details, TLS_ONLY)
    assert text.startswith("EtcdTLSError: ") and "requires a client certificate" in text
    text = failed(Code.UNAVAILABLE, details, CERT_USER)
    assert text.startswith("EtcdTLSError: ")
    assert "refused the client certificate /etc/partq/partq.pem" in text


def test_https_to_a_plain_server_and_http_to_a_tls_one() -> None:
    to_plain = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:2379: "
    text = failed(Code.UNAVAILABLE, to_plain + "Handshake read failed (Socket closed)")
    assert text.startswith("EtcdTLSError: ") and "does not speak TLS" in text
    text = failed(Code.UNAVAILABLE, to_plain + "Socket closed", Identity())
    assert text.startswith("EtcdUnavailable: ") and "use https://" in text


def test_not_reachable_is_still_is_it_running() -> None:
    details = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
        "Failed to connect to remote host: Connection refused"
    )
    text = failed(Code.UNAVAILABLE, details)
    assert text.startswith("EtcdUnavailable: ") and "is it running?" in text
    text = failed(Code.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert text.startswith("EtcdUnavailable: ") and "is it running?" in text


def test_resource_exhausted_says_what_ran_out_not_is_it_running() -> None:
    # Given gRPC's RESOURCE_EXHAUSTED for an answer over the client's receive limit
    too_big = failed(
        Code.RESOURCE_EXHAUSTED,
        "Received message larger than max (6815776 vs. 4194304)",
        op="read",
        key="/partq/v1/streams/shop/",
    )
    # Then the line says the answer was too large, for which read, and what to do
    assert "is it running" not in too_big
    assert too_big.startswith("EtcdError: ") and "6815776 bytes" in too_big
    assert "read /partq/v1/streams/shop/" in too_big and "etcdctl get --prefix" in too_big
    # And etcd's own exhaustion: out of space (final) and overloaded (tried again)
    full = failed(Code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")
    assert full.startswith("EtcdError: ") and "etcdctl alarm disarm" in full
    busy = translate(CallFailed(Code.RESOURCE_EXHAUSTED, "etcdserver: too many requests",
                                PASSWORD_USER), WHERE)  # fmt: skip
    assert type(busy) is EtcdUnavailable and "is it running" not in str(busy)
    assert "too many requests" in str(busy)


def test_a_refusal_is_not_retryable_and_an_outage_is() -> None:
    # Given each way etcd refuses us, translated at the edge
    denied = translate(CallFailed(Code.PERMISSION_DENIED, "etcdserver: permission denied",
                                  PASSWORD_USER, op="write", key="/partq/v1/x"), WHERE)  # fmt: skip
    wrong = translate(CallFailed(Code.INVALID_ARGUMENT, "etcdserver: authentication failed, "
                                 "invalid user ID or password", PASSWORD_USER), WHERE)  # fmt: skip
    untrusted = translate(CallFailed(Code.UNAVAILABLE, "CERTIFICATE_VERIFY_FAILED",
                                     PASSWORD_USER), WHERE)  # fmt: skip
    away = translate(CallFailed(Code.UNAVAILABLE, "Connection refused", PASSWORD_USER), WHERE)
    # Then a retry loop gives up on the refusals (their own branch, not EtcdUnavailable)
    for error in (denied, wrong, untrusted):
        assert isinstance(error, EtcdRefused) and not isinstance(error, EtcdUnavailable)
        assert isinstance(error, EtcdError) and not error.retryable and not retryable(error)
    assert (type(denied), type(wrong), type(untrusted)) == (
        EtcdPermissionDenied, EtcdAuthFailed, EtcdTLSError)  # fmt: skip
    # And tries again after an outage, as after a lost race or a broker away
    assert type(away) is EtcdUnavailable and retryable(away)
    for error in (NotLeader("deposed"), BrokerUnavailable("away")):
        assert retryable(error)
    # And nothing else is retryable: a usage error, a bug
    for other in (UsageError("bad"), MalformedValue("garbled"), ValueError("bug")):
        assert not retryable(other)


def test_watch_cancel_reasons_carry_the_status() -> None:
    expired = _cancel_status(
        "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token"
    )
    assert expired.code() == Code.UNAUTHENTICATED
    assert expired.details() == "etcdserver: invalid auth token"
    assert _cancel_status("etcdserver: permission denied").code() == Code.PERMISSION_DENIED
    assert _cancel_status("").code() == Code.CANCELLED


@pytest.mark.parametrize("endpoints", ["http://127.0.0.1:1", "127.0.0.1:1"])
def test_password_over_plain_http_is_refused_before_connecting(endpoints: str) -> None:
    settings = Settings(etcd_endpoints=endpoints, etcd_user="partq", etcd_password="secret")
    with pytest.raises(UsageError) as caught:
        connect(settings)
    text = str(caught.value)
    assert "need TLS" in text and "https://" in text and "--etcd-ca" in text
    assert "secret" not in text


def test_password_with_a_ca_is_not_refused(tmp_path: Path) -> None:
    # an http:// endpoint with --etcd-ca is dialled with TLS: the password is encrypted
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate: the refusal under test comes before it is used\n")
    settings = Settings(
        etcd_endpoints="http://127.0.0.1:1", etcd_user="partq", etcd_password="secret",
        etcd_ca=ca, etcd_timeout=0.5,
    )  # fmt: skip
    with pytest.raises(EtcdUnavailable):  # it got as far as dialling (nothing listens)
        connect(settings)


def test_permission_denied_hint_names_the_narrow_right_not_the_whole_tree() -> None:
    # a write to one key: write on that key
    text = failed(Code.PERMISSION_DENIED, "etcdserver: permission denied", op="write",
                  key="/partq/v1/streams/s/requests/rebalance")  # fmt: skip
    assert "grant its role write on /partq/v1/streams/s/requests/rebalance" in text
    assert "readwrite /partq/ " not in text and "/partq/)" not in text
    # a watch of a prefix: read on that prefix
    text = failed(Code.PERMISSION_DENIED, "etcdserver: permission denied", op="watch",
                  key="/partq/v1/streams/s/*")  # fmt: skip
    assert "--prefix=true read /partq/v1/streams/s/" in text
    # managing users and roles: no key to grant, the root role is what it needs
    text = failed(Code.PERMISSION_DENIED, "etcdserver: permission denied",
                  op="manage users and roles (needs etcd's root role)")  # fmt: skip
    assert "may not manage users and roles (needs etcd's root role)" in text
    assert "grant" not in text


def test_a_compacted_revision_is_its_own_error_not_an_outage() -> None:
    # etcd's answer to a read of a compacted revision, and a watch's compaction response
    read = translate(
        CallFailed(Code.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted",
                   PASSWORD_USER, "read", "/partq/v1/streams/s/claims/00001"),
        WHERE,
    )  # fmt: skip
    watched = translate(etcd3.exceptions.RevisionCompactedError(42), WHERE)
    for error in (read, watched):
        assert isinstance(error, EtcdCompacted) and not isinstance(error, EtcdUnavailable)
        assert retryable(error) and "read the current state again" in str(error)
    # A future revision is OUT_OF_RANGE too, and no compaction
    future = CallFailed(Code.OUT_OF_RANGE, "etcdserver: mvcc: required revision is a future "
                        "revision", PASSWORD_USER)  # fmt: skip
    assert not isinstance(translate(future, WHERE), EtcdCompacted)
