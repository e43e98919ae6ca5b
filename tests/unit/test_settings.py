"""Settings.load: flags > PARTQ_* environment > TOML file, validated, secrets redacted."""

from __future__ import annotations

from pathlib import Path

import pytest
from partq.producer import UsageError

from partq.kernel.amqp import DEFAULT_AMQP_URL
from partq.kernel.settings import DEFAULT_ETCD_ENDPOINTS, Settings

PARTQ_VARS = (
    "PARTQ_ETCD_ENDPOINTS",
    "PARTQ_ETCD_USER",
    "PARTQ_ETCD_PASSWORD",
    "PARTQ_ETCD_CA",
    "PARTQ_ETCD_CERT",
    "PARTQ_ETCD_KEY",
    "PARTQ_ETCD_TIMEOUT",
    "PARTQ_AMQP_URL",
    "PARTQ_HANDOFF",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PARTQ_* variable of the developer's shell leaks into these tests."""
    for name in PARTQ_VARS:
        monkeypatch.delenv(name, raising=False)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "partq.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    # Given no flag, no environment and no file
    # When the settings are loaded
    settings = Settings.load()
    # Then the documented defaults apply
    assert settings.etcd_endpoints == DEFAULT_ETCD_ENDPOINTS
    assert settings.amqp.url == DEFAULT_AMQP_URL
    assert settings.endpoints == [("127.0.0.1", 2379, False)]
    assert settings.etcd_timeout == 5.0


def test_file_is_used_when_nothing_else_is_set(tmp_path: Path) -> None:
    # Given only a TOML file
    config = write_toml(
        tmp_path,
        'etcd_endpoints = "http://file-host:1111"\n'
        'amqp_url = "amqp://guest:guest@file-host:5672/%2F"\n'
        "etcd_timeout = 7.5\n",
    )
    # When the settings are loaded from it
    settings = Settings.load(config)
    # Then every value comes from the file
    assert settings.endpoints == [("file-host", 1111, False)]
    assert settings.amqp.url == "amqp://guest:guest@file-host:5672/%2F"
    assert settings.etcd_timeout == 7.5


def test_environment_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a file and a PARTQ_ variable for the same setting
    config = write_toml(tmp_path, 'etcd_endpoints = "http://file-host:1111"\netcd_timeout = 7.5\n')
    monkeypatch.setenv("PARTQ_ETCD_ENDPOINTS", "http://env-host:2222")
    # When the settings are loaded
    settings = Settings.load(config)
    # Then the environment wins, and what only the file sets still comes from it
    assert settings.etcd_endpoints == "http://env-host:2222"
    assert settings.etcd_timeout == 7.5


def test_flags_beat_environment_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the same setting in a file, in the environment and as a flag
    config = write_toml(
        tmp_path,
        'etcd_endpoints = "http://file-host:1111"\n'
        'amqp_url = "amqp://guest:guest@file-host:5672/%2F"\n',
    )
    monkeypatch.setenv("PARTQ_ETCD_ENDPOINTS", "http://env-host:2222")
    monkeypatch.setenv("PARTQ_AMQP_URL", "amqp://guest:guest@env-host:5672/%2F")
    # When the flag is given (and a flag left unset is passed as None, as click does)
    settings = Settings.load(config, etcd_endpoints="http://flag-host:3333", amqp_url=None)
    # Then the flag wins where given, the environment where the flag was None
    assert settings.etcd_endpoints == "http://flag-host:3333"
    assert settings.amqp.url == "amqp://guest:guest@env-host:5672/%2F"


def test_several_endpoints_are_parsed() -> None:
    # Given a comma-separated list with a bare host and an https endpoint
    settings = Settings.load(etcd_endpoints="http://a:1, b ,https://c:3")
    # Then each becomes (host, port, tls), with the default port where none is given
    assert settings.endpoints == [("a", 1, False), ("b", 2379, False), ("c", 3, True)]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"etcd_endpoints": "ftp://x:1"}, "etcd endpoint 'ftp://x:1' must look like http://"),
        ({"etcd_endpoints": " , "}, "no etcd endpoint given"),
        ({"amqp_url": "http://guest:guest@h/"}, "must start with amqp:// or amqps://"),
        ({"etcd_timeout": "soon"}, "etcd_timeout"),
        ({"handoff": "priority"}, "handoff"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_invalid_values_are_usage_errors(overrides: dict[str, object], expected: str) -> None:
    # Given an invalid setting
    # When the settings are loaded
    with pytest.raises(UsageError) as caught:
        Settings.load(**overrides)
    # Then the error is a UsageError that names the problem
    assert str(caught.value).startswith("invalid settings: ")
    assert expected in str(caught.value)


def test_invalid_environment_value_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a bad value in the environment
    monkeypatch.setenv("PARTQ_ETCD_TIMEOUT", "never")
    # Then loading fails with a UsageError naming the setting
    with pytest.raises(UsageError, match="etcd_timeout"):
        Settings.load()


def test_unknown_key_in_file_is_a_usage_error(tmp_path: Path) -> None:
    # Given a TOML file with a misspelt key
    config = write_toml(tmp_path, 'etcd_endpoint = "http://h:1"\n')
    # Then loading it fails, naming the key
    with pytest.raises(UsageError, match="etcd_endpoint"):
        Settings.load(config)


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    # Given a config path that does not exist
    missing = tmp_path / "nope.toml"
    # Then loading fails and names the file
    with pytest.raises(UsageError, match=r"nope\.toml does not exist"):
        Settings.load(missing)


def test_settings_are_frozen() -> None:
    # Given loaded settings
    settings = Settings.load()
    # Then they cannot be changed afterwards
    with pytest.raises(Exception, match="frozen"):
        settings.etcd_timeout = 1.0  # type: ignore[misc]


def test_repr_and_str_never_show_passwords(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given passwords from a flag, the environment and the file
    config = write_toml(tmp_path, 'etcd_user = "root"\netcd_password = "file-pw-1"\n')
    monkeypatch.setenv("PARTQ_ETCD_PASSWORD", "env-pw-2")
    settings = Settings.load(config, amqp_url="amqp://user:flag-pw-3@h:5672/%2F")
    # When the settings are printed in every usual way
    shown = [repr(settings), str(settings), f"{settings}", repr(settings.model_dump())]
    # Then no password appears, but the secrets are still usable
    for text in shown:
        for secret in ("file-pw-1", "env-pw-2", "flag-pw-3"):
            assert secret not in text
    assert settings.etcd_password is not None
    assert settings.etcd_password.get_secret_value() == "env-pw-2"
    assert settings.amqp.url == "amqp://user:flag-pw-3@h:5672/%2F"


def test_validation_error_never_shows_the_amqp_password() -> None:
    # Given an AMQP URL with the wrong scheme and a password in it
    # When loading fails
    with pytest.raises(UsageError) as caught:
        Settings.load(amqp_url="http://user:s3cret-pw@h:5672/")
    # Then the message shows the URL redacted
    assert "s3cret-pw" not in str(caught.value)
    assert "user:***@h:5672" in str(caught.value)


def test_the_handoff_comes_from_the_environment_or_the_file_and_is_auto_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings.load().handoff == "auto"
    assert Settings.load(write_toml(tmp_path, 'handoff = "drain"')).handoff == "drain"
    monkeypatch.setenv("PARTQ_HANDOFF", "drain")
    assert Settings.load().handoff == "drain"
