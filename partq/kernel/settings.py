"""Connection settings: CLI flags > ``PARTQ_*`` environment > a TOML file.

Built once by the entry point, frozen, validated when built; passwords are
``SecretStr`` so they never show in ``repr``, logs or errors.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from partq.kernel.amqp import DEFAULT_AMQP_URL, AmqpTarget, AmqpTLS, redact_url, with_password
from partq.kernel.errors import UsageError

__all__ = [
    "DEFAULT_AMQP_OUTAGE_LIMIT",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_ETCD_ENDPOINTS",
    "DEFAULT_HANDOFF",
    "DEFAULT_STALL_AFTER",
    "MAX_CONCURRENCY",
    "Endpoint",
    "HttpSecurity",
    "Settings",
]

DEFAULT_ETCD_ENDPOINTS = "http://127.0.0.1:2379"
# Seconds a consumer stays in its group without a usable RabbitMQ connection: past it the
# member leaves, so its partitions move to members that can consume them. Longer than a
# broker restart (a node takes ~5 s to accept connections, reconnects back off to 5 s).
DEFAULT_AMQP_OUTAGE_LIMIT = 30.0
# Consumers: messages of different keys handled at once per member (1: one at a time per
# partition); PARTQ_CONCURRENCY or --concurrency.
DEFAULT_CONCURRENCY = 1
# At most: one handler thread each (partq.consumers.handling.runners.HandlerPool); more keys
# at once than this want more members, not more threads in one.
MAX_CONCURRENCY = 1024
# Consumers: seconds an owned partition may get nothing while messages are ready in its
# queue before it is reported stalled; PARTQ_STALL_AFTER.
DEFAULT_STALL_AFTER = 30.0
# Consumers: how a planned handoff moves a partition; auto: by consumer priority where the
# broker switches (RabbitMQ 4 quorum queues), else the drain. PARTQ_HANDOFF or --handoff.
Handoff = Literal["auto", "drain"]
DEFAULT_HANDOFF: Handoff = "auto"

Endpoint = tuple[str, int, bool]  # host, port, tls


@dataclass(frozen=True)
class HttpSecurity:
    """The daemons' HTTP port: TLS (certificate and key files) and the bearer token."""

    cert: Path | None = None
    key: Path | None = None
    token: SecretStr | None = None
    token_metrics: bool = False  # /metrics needs the token too

    @property
    def tls(self) -> bool:
        return self.cert is not None


class Settings(BaseSettings):
    """Where etcd and RabbitMQ are, and how to authenticate to them."""

    # Each field's docstring is its description (the settings reference, docs/reference).
    model_config = SettingsConfigDict(
        env_prefix="PARTQ_", frozen=True, extra="forbid", use_attribute_docstrings=True
    )

    etcd_endpoints: str = DEFAULT_ETCD_ENDPOINTS
    """etcd URLs, comma-separated (`http://` or `https://`); no user or password in them."""
    etcd_user: str | None = None
    """etcd user (password authentication; needs `https://` endpoints)."""
    etcd_password: SecretStr | None = None
    """etcd password: environment, file or TOML only, never a flag."""
    etcd_ca: Path | None = None
    """CA file that verifies etcd's certificate."""
    etcd_cert: Path | None = None
    """Client certificate for etcd (its CN is the user); needs `etcd_key`."""
    etcd_key: Path | None = None
    """Key of the etcd client certificate; needs `etcd_cert`."""
    etcd_timeout: float = 5.0
    """Seconds an etcd call may take before it fails."""
    amqp_url: SecretStr = SecretStr(DEFAULT_AMQP_URL)
    """RabbitMQ URL (`amqp://` or `amqps://`, user and password percent-encoded), or a
    comma-separated list of them, one per node."""
    amqp_ca: Path | None = None
    """CA file that verifies RabbitMQ's certificate (`amqps://`; else the system store)."""
    amqp_cert: Path | None = None
    """Client certificate for RabbitMQ; needs `amqp_key`."""
    amqp_key: Path | None = None
    """Key of the RabbitMQ client certificate; needs `amqp_cert`."""
    amqp_external_auth: bool = False
    """Authenticate to RabbitMQ with the client certificate (EXTERNAL)."""
    amqp_outage_limit: float = DEFAULT_AMQP_OUTAGE_LIMIT
    """Consumers: seconds a member stays in its group while RabbitMQ is unusable; past it,
    it leaves so its partitions move, and rejoins once RabbitMQ works."""
    concurrency: int = DEFAULT_CONCURRENCY
    """Consumers: messages of different keys a member handles at once (a key's own never
    overlap and keep their order); 1: one at a time per partition."""
    stall_after: float = DEFAULT_STALL_AFTER
    """Consumers: seconds an owned partition may get nothing while its queue has messages
    ready before it is reported stalled (`partition N: stalled`,
    `partq_consumer_stalled_partitions`); 0: never."""
    handoff: Handoff = DEFAULT_HANDOFF
    """Consumers: how a planned handoff moves a partition. `auto`: by consumer priority
    where RabbitMQ switches to a higher-priority waiting consumer once the active one has
    settled everything (4.0 and later, quorum queues): the next owner subscribes above the
    old one and the broker hands over, no drain; elsewhere the drain. `drain`: always the
    drain. Every member of a group should use the same (a member using `drain` is
    never handed a partition by priority). Default `auto`: on RabbitMQ 4 quorum queues an
    18-minute fault soak with hot standbys gave 0 order violations with it."""
    http_cert: Path | None = None
    """Certificate for HTTPS on the daemons' port; needs `http_key`."""
    http_key: Path | None = None
    """Key for HTTPS on the daemons' port; needs `http_cert`."""
    http_token: SecretStr | None = None
    """Bearer token the status page needs (the probes and `/metrics` stay open)."""
    http_token_metrics: bool = False
    """The token guards `/metrics` too."""
    # Secrets from files (a Kubernetes Secret mount), read when the settings are built and
    # then cleared: the value lands in etcd_password / amqp_url.
    etcd_password_file: Path | None = None
    """A file holding the etcd password (one trailing newline stripped)."""
    amqp_password_file: Path | None = None
    """A file holding the RabbitMQ password, put into every URL that names a user without one."""
    amqp_url_file: Path | None = None
    """A file holding the RabbitMQ URL (or list of URLs)."""
    http_token_file: Path | None = None
    """A file holding the HTTP bearer token."""

    @model_validator(mode="before")
    @classmethod
    def _read_secret_files(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if (path := data.pop("etcd_password_file", None)) is not None:
            if data.get("etcd_password") is not None:
                raise ValueError("set PARTQ_ETCD_PASSWORD or PARTQ_ETCD_PASSWORD_FILE, not both")
            data["etcd_password"] = _read_secret(path, "PARTQ_ETCD_PASSWORD_FILE")
        if (path := data.pop("http_token_file", None)) is not None:
            if data.get("http_token") is not None:
                raise ValueError("set PARTQ_HTTP_TOKEN or PARTQ_HTTP_TOKEN_FILE, not both")
            data["http_token"] = _read_secret(path, "PARTQ_HTTP_TOKEN_FILE")
        if (path := data.pop("amqp_url_file", None)) is not None:
            if data.get("amqp_url") is not None:
                raise ValueError("set PARTQ_AMQP_URL (--amqp-url) or PARTQ_AMQP_URL_FILE, not both")
            data["amqp_url"] = _read_secret(path, "PARTQ_AMQP_URL_FILE")
        if (path := data.pop("amqp_password_file", None)) is not None:
            url = data.get("amqp_url")
            if url is None:
                raise ValueError(
                    "PARTQ_AMQP_PASSWORD_FILE needs PARTQ_AMQP_URL naming the user, "
                    "e.g. amqp://partq@rabbitmq:5672/%2F"
                )
            if isinstance(url, SecretStr):
                url = url.get_secret_value()
            password = _read_secret(path, "PARTQ_AMQP_PASSWORD_FILE")
            try:
                data["amqp_url"] = with_password(str(url), password)
            except ValueError as e:
                raise ValueError(str(e)) from None
        return data

    @model_validator(mode="after")
    def _check_amqp_tls(self) -> Settings:
        if (self.amqp_cert is None) != (self.amqp_key is None):
            raise ValueError("set both PARTQ_AMQP_CERT and PARTQ_AMQP_KEY, or neither")
        if self.amqp_external_auth and self.amqp_cert is None:
            raise ValueError(
                "PARTQ_AMQP_EXTERNAL_AUTH needs a client certificate: "
                "set PARTQ_AMQP_CERT and PARTQ_AMQP_KEY"
            )
        if self.amqp_tls.configured and not self.amqp.url.startswith("amqps://"):
            raise ValueError(
                "PARTQ_AMQP_CA/CERT/KEY/EXTERNAL_AUTH are TLS settings: "
                "PARTQ_AMQP_URL must then be amqps://"
            )
        return self

    @model_validator(mode="after")
    def _check_etcd(self) -> Settings:
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ValueError(
                "set both --etcd-cert and --etcd-key (PARTQ_ETCD_CERT, PARTQ_ETCD_KEY), or neither"
            )
        if not self.etcd_timeout > 0:
            raise ValueError(f"the etcd timeout must be above 0 s, got {self.etcd_timeout}")
        return self

    @model_validator(mode="after")
    def _check_http(self) -> Settings:
        if (self.http_cert is None) != (self.http_key is None):
            raise ValueError(
                "set both --http-cert and --http-key (PARTQ_HTTP_CERT, PARTQ_HTTP_KEY), or neither"
            )
        token = self.http_token
        if token is not None and not token.get_secret_value().strip():
            raise ValueError(
                "the HTTP token (PARTQ_HTTP_TOKEN or PARTQ_HTTP_TOKEN_FILE) is empty: "
                "give a long random one, or unset it"
            )
        if self.http_token_metrics and token is None:
            raise ValueError(
                "--http-token-metrics (PARTQ_HTTP_TOKEN_METRICS) needs a token: "
                "set PARTQ_HTTP_TOKEN or PARTQ_HTTP_TOKEN_FILE"
            )
        return self

    @field_validator("etcd_endpoints")
    @classmethod
    def _check_endpoints(cls, value: str) -> str:
        parse_endpoints(value)
        return value

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value: int) -> int:
        if not 1 <= value <= MAX_CONCURRENCY:
            raise ValueError(
                f"must be a whole number between 1 and {MAX_CONCURRENCY} (one handler thread "
                f"each; run more members for more), got {value}"
            )
        return value

    @field_validator("amqp_outage_limit")
    @classmethod
    def _check_outage_limit(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"must be a number of seconds above 0, got {value}")
        return value

    @field_validator("stall_after")
    @classmethod
    def _check_stall_after(cls, value: float) -> float:
        if not value >= 0:
            raise ValueError(f"must be a number of seconds, 0 or more, got {value}")
        return value

    @field_validator("amqp_url")
    @classmethod
    def _check_amqp(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if not url.startswith(("amqp://", "amqps://")):
            shown = redact_url(url) if "://" in url else "(not shown: it may hold a password)"
            raise ValueError(f"the AMQP URL must start with amqp:// or amqps://; got {shown}")
        return value

    @property
    def endpoints(self) -> list[Endpoint]:
        return parse_endpoints(self.etcd_endpoints)

    @property
    def amqp_tls(self) -> AmqpTLS:
        return AmqpTLS(self.amqp_ca, self.amqp_cert, self.amqp_key, self.amqp_external_auth)

    @property
    def amqp(self) -> AmqpTarget:
        """The RabbitMQ URL with its TLS settings: what every component connects with."""
        return AmqpTarget(self.amqp_url.get_secret_value(), self.amqp_tls)

    @property
    def http(self) -> HttpSecurity:
        return HttpSecurity(self.http_cert, self.http_key, self.http_token, self.http_token_metrics)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Settings from ``overrides`` (CLI) > environment > ``config_file`` (TOML) > defaults.

        Without ``config_file``, the file named by ``PARTQ_CONFIG`` (if set) is read, as
        ``partq --config`` does: the SDK (``Producer("orders")``, ``consumers.run``, the
        Spark sink) finds its servers the way the command does.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if config_file is None and os.environ.get("PARTQ_CONFIG"):  # as `partq --config`
            config_file = Path(os.environ["PARTQ_CONFIG"])
        if config_file is not None and not config_file.is_file():
            raise UsageError(f"config file {config_file} does not exist")

        class _FromFile(cls):  # type: ignore[valid-type,misc]
            @classmethod
            def settings_customise_sources(
                cls,
                settings_cls: type[BaseSettings],
                init_settings: PydanticBaseSettingsSource,
                env_settings: PydanticBaseSettingsSource,
                dotenv_settings: PydanticBaseSettingsSource,
                file_secret_settings: PydanticBaseSettingsSource,
            ) -> tuple[PydanticBaseSettingsSource, ...]:
                sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
                if config_file is not None:
                    sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
                return tuple(sources)

        try:
            loaded = _FromFile(**given)
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"config file {config_file} is not valid TOML: {e}: fix it") from None
        except UnicodeDecodeError:
            raise UsageError(f"config file {config_file} is not UTF-8 text: fix it") from None
        except OSError as e:
            raise UsageError(f"cannot read config file {config_file}: {e.strerror or e}") from None
        except ValidationError as e:
            problems = "; ".join(_problem(err["loc"], err["msg"]) for err in e.errors())
            raise UsageError(f"invalid settings: {problems}") from None
        return cls.model_validate(loaded.model_dump())


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """``field: message``; a check of several settings has no field, and pydantic's
    "Value error, " prefix says nothing to the reader."""
    message = message.removeprefix("Value error, ")
    return f"{'.'.join(str(p) for p in loc)}: {message}" if loc else message


def _read_secret(path: Any, setting: str) -> str:
    """The file's text without one trailing newline (as a Kubernetes Secret mount gives it)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {setting} {path}: {e.strerror or e}") from None
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[: -len(end)]
    return text


def parse_endpoints(value: str) -> list[Endpoint]:
    """``http://h:2379,https://h2:2379`` → ``[(h, 2379, False), (h2, 2379, True)]``."""
    endpoints: list[Endpoint] = []
    for raw in (part.strip() for part in value.split(",")):
        if not raw:
            continue
        url = raw if "://" in raw else f"http://{raw}"
        if "@" in url:
            raise ValueError(
                f"etcd endpoint {redact_url(url)!r} holds a user name or password: partq "
                "does not take them from the URL; set PARTQ_ETCD_USER and PARTQ_ETCD_PASSWORD "
                "(or PARTQ_ETCD_PASSWORD_FILE)"
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"etcd endpoint {raw!r} must look like http://HOST:PORT or https://HOST:PORT"
            )
        endpoints.append((parts.hostname, parts.port or 2379, parts.scheme == "https"))
    if not endpoints:
        raise ValueError("no etcd endpoint given: e.g. http://127.0.0.1:2379")
    return endpoints
