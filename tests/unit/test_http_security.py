"""partq.cli.web: the bearer token (which paths it guards, what a refusal looks like) and the
start-up warning. TLS against real certificates: tests/observability/test_http_security.py."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import SecretStr

from partq.cli.web import exposure_warning, server_context
from partq.kernel.errors import UsageError
from partq.kernel.settings import HttpSecurity, Settings
from tests.unit.http_server import get

TOKEN = "s3cret-Token-9f2"


def page() -> str:
    return "<html>group detail</html>"


def test_with_a_token_the_page_and_unknown_paths_need_it(server: Callable[..., str]) -> None:
    # Given a server with a token
    base = server(page=page, security=HttpSecurity(token=SecretStr(TOKEN)))
    # When the page (or a path that does not exist) is asked for without it, or a wrong one
    for path in ("/", "/nothing-here", "/?format=json"):
        for token in (None, "wrong", TOKEN + "x", TOKEN[:-1], ""):
            status, body, headers = get(base + path, token)
            # Then 401 with a Bearer challenge and one line that says what to send
            assert status == 401, (path, token)
            assert headers["WWW-Authenticate"].startswith("Bearer"), headers
            assert body.count("\n") == 1 and "Authorization: Bearer" in body, body
            assert "group detail" not in body and TOKEN not in body
    # And with the token the page is served and a missing path is a 404
    assert get(base + "/", TOKEN)[:2] == (200, "<html>group detail</html>")
    assert get(base + "/nothing-here", TOKEN)[0] == 404


def test_probes_and_metrics_stay_open_unless_metrics_are_guarded(
    server: Callable[..., str],
) -> None:
    # Given one server whose token guards the page only, and one that guards /metrics too
    page_only = server(page=page, security=HttpSecurity(token=SecretStr(TOKEN)))
    metrics_too = server(security=HttpSecurity(token=SecretStr(TOKEN), token_metrics=True))
    # Then the probes answer without a token on both
    for base in (page_only, metrics_too):
        assert get(base + "/livez")[0] == 200
        assert get(base + "/readyz")[0] == 200
    # And /metrics is open on the first, and needs the token on the second
    assert get(page_only + "/metrics")[0] == 200
    assert get(metrics_too + "/metrics")[0] == 401
    status, body, _ = get(metrics_too + "/metrics", TOKEN)
    assert status == 200 and "python_info" in body


def test_without_a_token_everything_is_open(server: Callable[..., str]) -> None:
    base = server(page=page)
    assert get(base + "/")[0] == 200
    assert get(base + "/", "anything")[0] == 200


def test_the_scheme_is_case_insensitive_and_other_schemes_are_refused(
    server: Callable[..., str],
) -> None:
    base = server(page=page, security=HttpSecurity(token=SecretStr(TOKEN)))

    def with_header(value: str) -> int:
        request = urllib.request.Request(base + "/", headers={"Authorization": value})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return e.code

    assert with_header(f"bearer {TOKEN}") == 200
    assert with_header(f"Basic {TOKEN}") == 401
    assert with_header(TOKEN) == 401


@pytest.mark.parametrize(
    ("host", "security", "expected"),
    [
        ("127.0.0.1", HttpSecurity(), None),
        ("127.0.0.2", HttpSecurity(), None),
        ("::1", HttpSecurity(), None),
        ("localhost", HttpSecurity(), None),
        ("0.0.0.0", HttpSecurity(), "has no token"),
        ("", HttpSecurity(), "has no token"),
        ("partq-coordinator", HttpSecurity(), "has no token"),
        ("0.0.0.0", HttpSecurity(token=SecretStr(TOKEN)), "plain HTTP"),
        (
            "0.0.0.0",
            HttpSecurity(Path("c.pem"), Path("k.pem"), SecretStr(TOKEN)),
            None,
        ),
    ],
)
def test_a_port_open_beyond_loopback_is_warned_about(
    host: str, security: HttpSecurity, expected: str | None
) -> None:
    warning = exposure_warning(host, security)
    if expected is None:
        assert warning is None
    else:
        assert warning is not None and expected in warning
        assert TOKEN not in warning


def test_a_missing_certificate_is_one_line_naming_the_flags(tmp_path: Path) -> None:
    missing = HttpSecurity(tmp_path / "none.pem", tmp_path / "none.key")
    with pytest.raises(UsageError) as caught:
        server_context(missing)
    message = str(caught.value)
    assert "\n" not in message
    assert "--http-cert" in message and "none.pem" in message and "--http-key" in message


def test_a_file_that_is_not_a_certificate_is_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(UsageError, match="give a PEM certificate") as caught:
        server_context(HttpSecurity(junk, junk))
    assert "\n" not in str(caught.value)


# -- settings ----------------------------------------------------------------------------

HTTP_VARS = (
    "PARTQ_HTTP_CERT",
    "PARTQ_HTTP_KEY",
    "PARTQ_HTTP_TOKEN",
    "PARTQ_HTTP_TOKEN_FILE",
    "PARTQ_HTTP_TOKEN_METRICS",
    "PARTQ_CONFIG",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in HTTP_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_token_comes_from_a_file_without_its_newline(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    # Given a Secret mounted as a file, with the trailing newline kubectl leaves
    secret = tmp_path / "http-token"
    secret.write_text(TOKEN + "\n")
    clean_env.setenv("PARTQ_HTTP_TOKEN_FILE", str(secret))
    # When the settings are loaded
    settings = Settings.load()
    # Then the token is the file's text, and never shows in repr
    assert settings.http.token is not None
    assert settings.http.token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in repr(settings.http)


def test_cert_key_and_token_from_the_toml_file(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "partq.toml"
    config.write_text(
        f'http_cert = "/etc/partq/http.pem"\nhttp_key = "/etc/partq/http.key"\n'
        f'http_token = "{TOKEN}"\nhttp_token_metrics = true\n'
    )
    http = Settings.load(config).http
    assert (http.cert, http.key) == (Path("/etc/partq/http.pem"), Path("/etc/partq/http.key"))
    assert http.tls and http.token_metrics


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PARTQ_HTTP_CERT": "/c.pem"}, "set both --http-cert and --http-key"),
        ({"PARTQ_HTTP_KEY": "/k.pem"}, "set both --http-cert and --http-key"),
        ({"PARTQ_HTTP_TOKEN": "  "}, "is empty"),
        ({"PARTQ_HTTP_TOKEN_METRICS": "true"}, "needs a token"),
        ({"PARTQ_HTTP_TOKEN": TOKEN, "PARTQ_HTTP_TOKEN_FILE": "/x"}, "not both"),
        ({"PARTQ_HTTP_TOKEN_FILE": "/nonexistent/token"}, "cannot read PARTQ_HTTP_TOKEN_FILE"),
    ],
)
def test_bad_http_settings_are_one_line_usage_errors(
    env: dict[str, str], expected: str, clean_env: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(UsageError, match=expected) as caught:
        Settings.load()
    assert "\n" not in str(caught.value) and TOKEN not in str(caught.value)
