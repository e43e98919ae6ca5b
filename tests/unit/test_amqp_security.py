"""AMQP security without a broker: redaction of any URL shape, secrets from files, TLS
settings reaching pika, etcd endpoints with userinfo refused, a password in argv warned.

(Issue 9 items 2-4; the broker half is tests/integration/test_amqp_tls.py.)
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from urllib.parse import quote

import pika
import pika.credentials
import pika.exceptions
import pytest

from partq.cli import main
from partq.kernel import logs
from partq.kernel.amqp import (
    AmqpTarget,
    AmqpTLS,
    Nodes,
    access_refused,
    connection_parameters,
    has_password,
    redact_url,
    targets,
    unavailable,
    with_password,
)
from partq.kernel.errors import UsageError
from partq.kernel.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PARTQ_* variable of the developer's shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("PARTQ_"):
            monkeypatch.delenv(name)


# -- redaction ------------------------------------------------------------------------

SECRET = "Zq7sEcRet"  # appears nowhere else in the URLs below
PASSWORDS = [f"{SECRET}{c}x" for c in "@:/?#%"] + [f"a{c}{SECRET}" for c in "@:/?#%"]


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("encoded", [True, False], ids=["encoded", "raw"])
@pytest.mark.parametrize(
    "shape",
    [
        "amqp://partq:{pw}@rabbit.example:5672/%2F",
        "amqps://partq:{pw}@rabbit.example/vhost?heartbeat=30",
        "amqp://partq:{pw}@rabbit.example",
        "amqp://:{pw}@rabbit.example/",
        "amqp://partq:{pw}@[::1]:5672/%2F",
        "amqp://partq:{pw}",  # no host
        "amqp://partq:{pw}@",  # an empty host
    ],
)
def test_redact_url_never_prints_the_password(shape: str, password: str, encoded: bool) -> None:
    # Given a URL of any shape whose password holds @ : / ? # or %, encoded or not
    if not encoded and "@" in password and "@" not in shape:
        pytest.skip("amqp://u:a@SECRET is a URL: user u, password a, host SECRET")
    url = shape.format(pw=quote(password, safe="") if encoded else password)
    # When it is redacted (as errors, logs and reprs do)
    shown = [
        redact_url(url),
        redact_url(AmqpTarget(url)),
        str(AmqpTarget(url)),
        repr(AmqpTarget(url)),
        logs._redact(f"connecting to {url} now"),
    ]
    # Then the password never shows, and something stands in for it
    for text in shown:
        assert SECRET not in text, text
        assert "***" in text, text


@pytest.mark.parametrize(
    "url", ["amqp://partq:pw-Zq7sEcRet", "amqp://partq:Zq7sEcRet/%2F", "amqps://u:Zq7sEcRet?x=1"]
)
def test_a_url_without_a_host_prints_as_stars(url: str) -> None:
    # Given "amqp://u:pw" with no host: the ':' is not followed by a port number
    assert redact_url(url) == url.split("://", maxsplit=1)[0] + "://***"


@pytest.mark.parametrize("text", ["Zq7sEcRet", "amqp:/u:Zq7sEcRet@h", "u:Zq7sEcRet@h:5672"])
def test_what_cannot_be_parsed_prints_as_amqp_stars(text: str) -> None:
    assert redact_url(text) == "amqp://***"


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest@127.0.0.1:5672/%2F",
        "amqp://127.0.0.1:5672/%2F",
        "amqps://rabbit.example/vhost?heartbeat=30",
        "amqp://[::1]:5672/%2F",
    ],
)
def test_a_url_without_a_password_prints_unchanged(url: str) -> None:
    assert redact_url(url) == url
    assert not has_password(url)


def test_has_password() -> None:
    assert has_password("amqp://u:pw@h/%2F")
    assert has_password("amqp://u:p/w@h/%2F")
    assert has_password("amqp://u:pw")
    assert not has_password("amqp://u@h:5672/%2F")


def test_an_unencoded_password_is_refused_with_a_hint_not_echoed() -> None:
    # Given a password with a raw '/' (pika would read "pa" as the port)
    url = f"amqp://partq:{SECRET}/x@rabbit.example/%2F"
    # When pika parameters are made, Then the error says to percent-encode, hiding it
    with pytest.raises(UsageError, match="percent-encoded") as caught:
        connection_parameters(url, name="t")
    assert SECRET not in str(caught.value)


def test_a_raw_at_in_the_password_still_parses() -> None:
    params = connection_parameters(f"amqp://partq:{SECRET}@x@rabbit.example/%2F", name="t")
    assert params.host == "rabbit.example"
    assert params.credentials.password == f"{SECRET}@x"


# -- secrets from files -----------------------------------------------------------------


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_amqp_password_file_is_percent_encoded_into_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a Secret mount holding a password with every awkward character, and a newline
    password = "a@b:c/d?e#f%g h"
    monkeypatch.setenv("PARTQ_AMQP_URL", "amqp://partq@rabbit.example:5672/%2F")
    monkeypatch.setenv("PARTQ_AMQP_PASSWORD_FILE", str(_secret(tmp_path, "pw", password + "\n")))
    # When the settings are loaded
    settings = Settings.load()
    # Then pika reads back exactly that password (one trailing newline stripped)
    params = connection_parameters(settings.amqp, name="t")
    assert params.credentials.username == "partq"
    assert params.credentials.password == password
    assert params.host == "rabbit.example"
    assert "a@b" not in repr(settings) and "a@b" not in str(settings.amqp)


def test_amqp_url_file_is_the_whole_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"amqps://partq:{SECRET}@rabbit.example:5671/prod"
    monkeypatch.setenv("PARTQ_AMQP_URL_FILE", str(_secret(tmp_path, "url", url + "\n")))
    settings = Settings.load()
    assert settings.amqp.url == url
    assert SECRET not in repr(settings)


def test_only_one_trailing_newline_is_stripped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTQ_ETCD_USER", "partq")
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD_FILE", str(_secret(tmp_path, "pw", "pw\n\n")))
    settings = Settings.load()
    assert settings.etcd_password is not None
    assert settings.etcd_password.get_secret_value() == "pw\n"


def test_etcd_password_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTQ_ETCD_USER", "partq")
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD_FILE", str(_secret(tmp_path, "pw", f"{SECRET}\n")))
    settings = Settings.load()
    assert settings.etcd_password is not None
    assert settings.etcd_password.get_secret_value() == SECRET
    assert SECRET not in repr(settings)


def test_secret_files_from_toml(tmp_path: Path) -> None:
    pw = _secret(tmp_path, "pw", f"{SECRET}\n")
    config = _secret(
        tmp_path,
        "partq.toml",
        f'amqp_url = "amqp://partq@h:5672/%2F"\namqp_password_file = "{pw}"\n',
    )
    settings = Settings.load(config)
    assert settings.amqp.url == f"amqp://partq:{SECRET}@h:5672/%2F"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PARTQ_AMQP_URL": "amqp://u:pw@h/%2F", "PARTQ_AMQP_URL_FILE": "{f}"}, "not both"),
        ({"PARTQ_ETCD_PASSWORD": "pw", "PARTQ_ETCD_PASSWORD_FILE": "{f}"}, "not both"),
        ({"PARTQ_AMQP_URL": "amqp://u:pw@h/%2F", "PARTQ_AMQP_PASSWORD_FILE": "{f}"}, "not both"),
        ({"PARTQ_AMQP_URL": "amqp://h/%2F", "PARTQ_AMQP_PASSWORD_FILE": "{f}"}, "the user"),
        ({"PARTQ_AMQP_PASSWORD_FILE": "{f}"}, "naming the user"),
        ({"PARTQ_AMQP_URL_FILE": "/nonexistent/partq-url"}, "cannot read PARTQ_AMQP_URL_FILE"),
    ],
)
def test_secret_file_conflicts_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    f = _secret(tmp_path, "secret", f"{SECRET}\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(f=f))
    with pytest.raises(UsageError, match=message) as caught:
        Settings.load()
    assert SECRET not in str(caught.value)


# -- etcd endpoints ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoints",
    [
        f"https://root:{SECRET}@etcd.example:2379",
        f"root:{SECRET}@etcd.example:2379",
        f"http://a:2379,https://root:{SECRET}@b:2379",
        "https://root@etcd.example:2379",
    ],
)
def test_userinfo_in_etcd_endpoints_is_refused(endpoints: str) -> None:
    with pytest.raises(UsageError, match="PARTQ_ETCD_USER") as caught:
        Settings.load(etcd_endpoints=endpoints)
    assert SECRET not in str(caught.value)


# -- TLS settings reach pika ------------------------------------------------------------


def _pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    from tests.pki import issue, make_ca

    ca, _ = make_ca(tmp_path, "ca")
    cert, key = issue(tmp_path, "ca", "client", "partq", "DNS:partq")
    return ca, cert, key


def test_tls_settings_make_a_verifying_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given amqps:// with a CA, a client certificate and EXTERNAL auth in the environment
    ca, cert, key = _pki(tmp_path)
    monkeypatch.setenv("PARTQ_AMQP_URL", "amqps://rabbit.example:5671/%2F")
    monkeypatch.setenv("PARTQ_AMQP_CA", str(ca))
    monkeypatch.setenv("PARTQ_AMQP_CERT", str(cert))
    monkeypatch.setenv("PARTQ_AMQP_KEY", str(key))
    monkeypatch.setenv("PARTQ_AMQP_EXTERNAL_AUTH", "true")
    # When pika parameters are made from the settings
    settings = Settings.load()
    params = connection_parameters(settings.amqp, name="t")
    # Then the context verifies the server and its name, and EXTERNAL replaces PLAIN
    assert settings.amqp.tls == AmqpTLS(ca, cert, key, True)
    context = params.ssl_options.context
    assert context.check_hostname is True
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert params.ssl_options.server_hostname == "rabbit.example"
    assert isinstance(params.credentials, pika.credentials.ExternalCredentials)


def test_amqps_without_a_ca_verifies_against_the_system_store() -> None:
    params = connection_parameters("amqps://u:pw@rabbit.example/%2F", name="t")
    assert params.ssl_options is not None
    assert params.ssl_options.context.check_hostname is True
    assert params.ssl_options.context.verify_mode == ssl.CERT_REQUIRED
    assert params.port == 5671


def test_flags_set_the_tls_files(tmp_path: Path) -> None:
    ca, cert, key = _pki(tmp_path)
    settings = Settings.load(amqp_url="amqps://h/%2F", amqp_ca=ca, amqp_cert=cert, amqp_key=key)
    assert settings.amqp.tls == AmqpTLS(ca, cert, key)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"amqp_url": "amqp://h/%2F", "amqp_ca": "/ca.pem"}, "must then be amqps://"),
        ({"amqp_url": "amqps://h/%2F", "amqp_cert": "/c.pem"}, "both PARTQ_AMQP_CERT"),
        ({"amqp_url": "amqps://h/%2F", "amqp_external_auth": True}, "needs a client cert"),
    ],
)
def test_inconsistent_tls_settings_are_usage_errors(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        Settings.load(**overrides)


def test_a_missing_ca_file_is_a_usage_error(tmp_path: Path) -> None:
    where = AmqpTarget("amqps://h/%2F", AmqpTLS(ca=tmp_path / "nope.pem"))
    with pytest.raises(UsageError, match=r"nope\.pem"):
        connection_parameters(where, name="t")


# -- the command line -------------------------------------------------------------------


def test_a_password_in_amqp_url_argv_warns_and_is_never_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given --amqp-url with a password on the command line (and a setting that fails)
    url = f"amqp://partq:{SECRET}@rabbit.example:5672/%2F"
    code = main(["--amqp-url", url, "--amqp-cert", "/c.pem", "stream", "describe", "s"])
    out, err = capsys.readouterr()
    # Then one line warns that argv shows in ps and names the variables to use instead
    assert code == 2
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "ps" in warnings[0] and "PARTQ_AMQP_URL_FILE" in warnings[0]
    assert SECRET not in out + err


def test_no_warning_without_a_password(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--amqp-url", "amqp://partq@h/%2F", "--amqp-cert", "/c.pem", "stream", "describe", "s"])
    assert "warning" not in capsys.readouterr().err


# -- error translation of the asynchronous path (the producer's and consumers' loops) ----


def _workflow_failed(inner: BaseException) -> BaseException:
    from pika.adapters.utils import connection_workflow as cw

    return cw.AMQPConnectionWorkflowFailed([cw.AMQPConnectorTransportSetupError(inner)])


def test_a_wrapped_certificate_failure_still_names_the_ca_file(tmp_path: Path) -> None:
    # Given the SelectConnection's report: a workflow failure wrapping the TLS error
    error = ssl.SSLCertVerificationError(1, "certificate verify failed")
    error.verify_message = "unable to get local issuer certificate"
    where = AmqpTarget(f"amqps://u:{SECRET}@h/%2F", AmqpTLS(ca=tmp_path / "ca.pem"))
    # When it is translated, Then the certificate line names the CA file, not "is it running"
    message = str(unavailable(where, _workflow_failed(error)))
    assert f"not trusted by the CA file {tmp_path / 'ca.pem'}" in message
    assert SECRET not in message


def test_a_wrapped_authentication_failure_says_so() -> None:
    error = pika.exceptions.ProbableAuthenticationError("ACCESS_REFUSED - Login was refused")
    message = str(unavailable(f"amqp://u:{SECRET}@h/%2F", _workflow_failed(error)))
    assert "authentication failed" in message
    assert SECRET not in message


def test_an_unparseable_host_is_a_usage_error_without_the_password() -> None:
    with pytest.raises(UsageError, match="bad AMQP URL") as caught:
        connection_parameters(f"amqp://u:{SECRET}@[::1/%2F", name="t")
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("reply", "permission", "expected"),
    [  # RabbitMQ 3.10 does not name the permission; later versions do
        ("ACCESS_REFUSED - access to queue 'partq.s.p00001' in vhost '/' refused for user "
         "'u1'", "read", "user 'u1' may not read queue 'partq.s.p00001' in vhost '/': grant "
         "it read permission"),
        ("ACCESS_REFUSED - write access to exchange 'partq.s' in vhost 'v' refused for user "
         "'u1'", None, "user 'u1' may not write exchange 'partq.s' in vhost 'v': grant it "
         "write permission"),
        ("ACCESS_REFUSED - access to queue 'q' in vhost '/' refused for user 'u1'", None,
         "user 'u1' may not use queue 'q'"),
        ("ACCESS_REFUSED - something new", None, "permission denied: ACCESS_REFUSED - something"),
    ],
)  # fmt: skip
def test_access_refused_names_user_queue_and_what_to_grant(
    reply: str, permission: str | None, expected: str
) -> None:
    line = access_refused("amqp://u1:hunter2@h:5672/%2F", reply, permission)
    assert expected in line and "\n" not in line and "hunter2" not in line
    if "may not" in line:
        assert "rabbitmqctl set_permissions -p" in line


# -- URL lists ---------------------------------------------------------------------------


SECRET_LIST = "amqp://a:pw%2Cx@n1:5672/%2F, amqps://b:s%40cret@n2:5671/%2F,amqp://n3:5672/%2F"


def test_a_url_list_is_split_at_each_scheme_and_keeps_commas_in_passwords() -> None:
    entries = [t.url for t in targets(SECRET_LIST)]
    assert entries == [
        "amqp://a:pw%2Cx@n1:5672/%2F",
        "amqps://b:s%40cret@n2:5671/%2F",
        "amqp://n3:5672/%2F",
    ]
    assert [t.url for t in targets("amqp://u:p,w@h:5672/%2F")] == ["amqp://u:p,w@h:5672/%2F"]
    for bad in ("amqp://h1:5672/%2F,,amqp://h2:5672/%2F", "amqp://h1:5672/%2F,"):
        with pytest.raises(UsageError, match="empty entry"):
            targets(bad)


def test_a_url_list_is_redacted_entry_by_entry() -> None:
    shown = redact_url(SECRET_LIST)
    assert "pw" not in shown and "s%40cret" not in shown
    assert shown == "amqp://a:***@n1:5672/%2F,amqps://b:***@n2:5671/%2F,amqp://n3:5672/%2F"
    assert has_password(SECRET_LIST) and not has_password("amqp://h1/%2F,amqp://u@h2/%2F")


def test_a_password_file_fills_every_entry_that_names_a_user_without_one() -> None:
    listed = with_password("amqp://u@h1:5672/%2F,amqp://v:own@h2:5672/%2F,amqp://h3/%2F", "p/w")
    assert listed == "amqp://u:p%2Fw@h1:5672/%2F,amqp://v:own@h2:5672/%2F,amqp://h3/%2F"


def test_nodes_go_round_robin_and_a_single_url_stays_put() -> None:
    nodes = Nodes.of("amqp://g:g@127.0.0.1:1/%2F,amqp://g:g@127.0.0.1:2/%2F", name="t")
    assert nodes.current.port == 1 and nodes.where.url.endswith(":1/%2F")
    nodes.advance()
    assert nodes.current.port == 2
    nodes.advance()
    assert nodes.current.port == 1
    single = Nodes.of("amqp://g:g@127.0.0.1:3/%2F", name="t")
    single.advance()
    assert single.current.port == 3
    with pytest.raises(UsageError, match="one AMQP URL is needed"):
        connection_parameters("amqp://h1/%2F,amqp://h2/%2F", name="t")
