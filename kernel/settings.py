"""Connection settings: CLI flags > ``PARTQ_*`` environment > a TOML file.

Built once by the entry point, frozen, validated when built; passwords are
``SecretStr`` so they never show in ``repr``, logs or errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kernel.amqp import DEFAULT_AMQP_URL, redact_url
from kernel.errors import UsageError

__all__ = ["DEFAULT_ETCD_ENDPOINTS", "Endpoint", "Settings"]

DEFAULT_ETCD_ENDPOINTS = "http://127.0.0.1:2379"

Endpoint = tuple[str, int, bool]  # host, port, tls


class Settings(BaseSettings):
    """Where etcd and RabbitMQ are, and how to authenticate to them."""

    model_config = SettingsConfigDict(env_prefix="PARTQ_", frozen=True, extra="forbid")

    etcd_endpoints: str = DEFAULT_ETCD_ENDPOINTS
    etcd_user: str | None = None
    etcd_password: SecretStr | None = None
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    etcd_timeout: float = 5.0
    amqp_url: SecretStr = SecretStr(DEFAULT_AMQP_URL)

    @field_validator("etcd_endpoints")
    @classmethod
    def _check_endpoints(cls, value: str) -> str:
        parse_endpoints(value)
        return value

    @field_validator("amqp_url")
    @classmethod
    def _check_amqp(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if not url.startswith(("amqp://", "amqps://")):
            raise ValueError(f"{redact_url(url)!r} must start with amqp:// or amqps://")
        return value

    @property
    def endpoints(self) -> list[Endpoint]:
        return parse_endpoints(self.etcd_endpoints)

    @property
    def amqp(self) -> str:
        return self.amqp_url.get_secret_value()

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
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise UsageError(f"invalid settings: {problems}") from None
        return cls.model_validate(loaded.model_dump())


def parse_endpoints(value: str) -> list[Endpoint]:
    """``http://h:2379,https://h2:2379`` → ``[(h, 2379, False), (h2, 2379, True)]``."""
    endpoints: list[Endpoint] = []
    for raw in (part.strip() for part in value.split(",")):
        if not raw:
            continue
        parts = urlsplit(raw if "://" in raw else f"http://{raw}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"etcd endpoint {raw!r} must look like http://HOST:PORT or https://HOST:PORT"
            )
        endpoints.append((parts.hostname, parts.port or 2379, parts.scheme == "https"))
    if not endpoints:
        raise ValueError("no etcd endpoint given: e.g. http://127.0.0.1:2379")
    return endpoints
