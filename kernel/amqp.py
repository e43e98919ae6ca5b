"""The RabbitMQ edge shared by every component: URLs, connection set-up, error translation.

pika's connection errors are translated here into :mod:`kernel.errors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions

from kernel.errors import BrokerUnavailable, UsageError

__all__ = [
    "DEFAULT_AMQP_URL",
    "blocking_connection",
    "connect_blocking",
    "connection_parameters",
    "redact_url",
    "unavailable",
]

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def connection_parameters(
    url: str, *, name: str, heartbeat: int | None = None
) -> pika.URLParameters:
    if not url.startswith(("amqp://", "amqps://")):
        raise UsageError(
            f"AMQP URL {redact_url(url)!r} must start with amqp:// or amqps://, "
            f"e.g. {DEFAULT_AMQP_URL!r}"
        )
    try:
        params = pika.URLParameters(url)
    except Exception as e:  # pika raises ValueError and friends for bad query strings
        raise UsageError(f"bad AMQP URL {redact_url(url)!r}: {e}") from None
    params.client_properties = {"connection_name": name, "product": "partq"}
    if heartbeat is not None:
        params.heartbeat = heartbeat
    params.blocked_connection_timeout = 60
    return params


def unavailable(url: str, error: BaseException) -> BrokerUnavailable:
    detail = str(error) or type(error).__name__
    if isinstance(error, pika.exceptions.ProbableAuthenticationError):
        hint = "check the user and password"
    elif isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        hint = "check the user's permissions on the virtual host"
    else:
        hint = "is it running? (set PARTQ_AMQP_URL or --amqp-url)"
    return BrokerUnavailable(f"cannot reach RabbitMQ at {redact_url(url)}: {hint} ({detail})")


def connect_blocking(url: str, *, name: str = "partq-admin") -> pika.BlockingConnection:
    """A ``BlockingConnection`` (one attempt, 5 s socket timeout); the caller closes it."""
    params = connection_parameters(url, name=name)
    params.connection_attempts = 1
    params.socket_timeout = 5
    try:
        return pika.BlockingConnection(params)
    except pika.exceptions.AMQPError as e:
        raise unavailable(url, e) from None


@contextmanager
def blocking_connection(
    url: str, *, name: str = "partq-admin"
) -> Iterator[pika.BlockingConnection]:
    connection = connect_blocking(url, name=name)
    try:
        yield connection
    finally:
        if connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()
