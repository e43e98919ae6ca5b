"""Logs for partq's daemons: JSON lines for machines, readable text for people.

The entry point calls :func:`configure` once. Code that works on a stream, a
partition or as a member wraps that work in :func:`bind`; every record logged
inside it, in that thread or asyncio task, carries those fields::

    with bind(stream="orders", member="consumer-0"):
        with bind(partition=7):
            log.info("draining")   # {"stream": "orders", "partition": 7, ...}

Passwords in URLs never reach the output: callers format URLs with
``partq.kernel.amqp.redact_url``, and the formatters redact any URL left in a
message or traceback the same way.
"""

from __future__ import annotations

import json as jsonlib
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Final

from partq.kernel.amqp import redact_url
from partq.kernel.errors import UsageError

__all__ = [
    "CONTEXT_FIELDS",
    "HANDLER_NAME",
    "PIKA_TRANSPORT",
    "QUIET_LIBRARIES",
    "bind",
    "bound",
    "configure",
    "configure_if_unset",
]

CONTEXT_FIELDS: Final = ("stream", "partition", "member")
QUIET_LIBRARIES: Final = ("pika", "grpc", "etcd3", "py4j")
# pika's transport logs every TCP stream that ends at ERROR, partq's own aborts included (a
# fence; a hot standby given back, on its own connection): partq logs the losses it did
# not cause itself (``partq.consumers.broker.connection``, ``partq.consumers.broker.channels``),
# with pika's reason.
PIKA_TRANSPORT: Final = ("pika.adapters.utils.io_services_utils", "pika.adapters.base_connection")

HANDLER_NAME: Final = "partq"
_EMPTY: Final[Mapping[str, str | int]] = MappingProxyType({})
_context: ContextVar[Mapping[str, str | int]] = ContextVar("partq_log_context", default=_EMPTY)
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)


@contextmanager
def bind(
    *, stream: str | None = None, partition: int | None = None, member: str | None = None
) -> Iterator[None]:
    """Add the given fields to every record logged inside the ``with`` block."""
    given = {"stream": stream, "partition": partition, "member": member}
    fields = {name: value for name, value in given.items() if value is not None}
    token = _context.set(MappingProxyType({**_context.get(), **fields}))
    try:
        yield
    finally:
        _context.reset(token)


def bound() -> Mapping[str, str | int]:
    """The fields :func:`bind` has set here, e.g. to hand to a worker thread."""
    return _context.get()


def configure(level: str, *, json: bool | None = None, stream: IO[str] | None = None) -> None:
    """Send logs at ``level`` and above to ``stream`` (stderr), replacing an earlier call.

    ``json=None`` writes JSON lines unless ``stream`` is a terminal; pika, grpc,
    etcd3 and py4j log only warnings and errors whatever ``level`` says, and pika's
    transport nothing below CRITICAL (``PIKA_TRANSPORT``).
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise UsageError(
            f"unknown log level {level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    out = sys.stderr if stream is None else stream
    as_json = not _is_terminal(out) if json is None else json

    handler = logging.StreamHandler(out)
    handler.set_name(HANDLER_NAME)
    handler.addFilter(_add_context)
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    for library in QUIET_LIBRARIES:
        logging.getLogger(library).setLevel(max(numeric, logging.WARNING))
    for transport in PIKA_TRANSPORT:
        logging.getLogger(transport).setLevel(logging.CRITICAL)


def configure_if_unset(level: str = "INFO") -> bool:
    """:func:`configure` unless the root logger has a handler already; whether it did.

    For library entry points such as ``consumers.run``: an application that set up
    its own logging keeps it, and one that did not still sees what partq says
    (Python's last-resort handler would drop everything below WARNING).
    """
    if logging.getLogger().handlers:
        return False
    configure(level)
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context, exception."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": _redact(record.getMessage()),
        }
        for field in CONTEXT_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                doc[field] = value
        if record.exc_info:
            doc["exception"] = _redact(self.formatException(record.exc_info))
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return jsonlib.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``2024-05-01 12:00:00,123 INFO  partq.consumers.control.daemon [stream=orders
    partition=7] draining``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s%(partq_context)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = [
            f"{field}={value}"
            for field in CONTEXT_FIELDS
            if (value := getattr(record, field, None)) is not None
        ]
        record.partq_context = f" [{' '.join(fields)}]" if fields else ""
        return _redact(super().format(record))


def _add_context(record: logging.LogRecord) -> bool:
    """Put the bound fields on ``record``; a field given with ``extra=`` wins."""
    for field, value in _context.get().items():
        if getattr(record, field, None) is None:
            setattr(record, field, value)
    return True


def _redact(text: str) -> str:
    return _URL.sub(lambda match: _redact_one(match.group(0)), text)


def _redact_one(url: str) -> str:
    try:
        return redact_url(url)
    except ValueError:  # not parseable as a URL (e.g. a bad IPv6 host): hide it all
        return "<url>"


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
