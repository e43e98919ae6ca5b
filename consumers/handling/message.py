"""What a handler receives, and how a handler is named on the command line.

Threads. None of its own: a :class:`Message` is made on a partition's worker thread (or a
handler pool thread with ``--concurrency``) and handed to the handler there, read-only.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partq.producer.contract import (
    HEADER_KEY,
    HEADER_KEY_B64,
    HEADER_PARTITION,
    HEADER_PUBLISHED_MS,
)
from partq.producer.spark.replay import HEADER_BATCH_ID, HEADER_QUERY_ID, HEADER_SEQ, ReplayId

from partq.kernel.errors import PartqError, UsageError

__all__ = [
    "Handler",
    "MalformedHeaders",
    "Message",
    "check_handler",
    "load_handler",
    "message_from",
]

HEADER_DELIVERY_COUNT = "x-delivery-count"  # set by quorum queues on redelivered messages


class MalformedHeaders(PartqError, ValueError):
    """A ``partq-*`` header of a delivery cannot be parsed.

    The consumer never hands such a message to the handler: it dead-letters it at
    once (``x-partq-error-type: MalformedHeaders``, ``x-partq-error`` naming the
    header and its value), acks it and goes on with the partition.
    """

    def __init__(self, header: str, value: object, expected: str) -> None:
        self.header = header
        self.value = value
        super().__init__(f"header {header}: {_show(value)} is not {expected}")


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery. The handler acks it by returning; raising retries it (up to a bound).

    ``attempt`` counts this consumer's handler attempts for this delivery, 1 to
    ``--max-attempts``: the retry bound counts these. A handler that raises
    anything (also ``SystemExit`` and ``KeyboardInterrupt``) spends one attempt;
    after the last the key is parked (the stream's ``on_failure = park``, the default for
    a new stream) or the message is dead-lettered (``on_failure = dead-letter``).

    ``delivery_count`` is the broker's ``x-delivery-count`` (quorum queues only; 0
    when absent), informational: both a redelivery after a consumer crashed and a
    delivery returned during a planned handoff count there. The quorum queues'
    own delivery limit (far above partq's retries) dead-letters a message that
    keeps crashing its consumers.

    ``fencing_token`` is the etcd revision of this consumer's claim on the partition when
    it began handling it: every later owner of the partition gets a greater one. A store
    written by the handler can keep the greatest token it has seen (per partition, or
    per key) and refuse a write that brings a smaller one: that refuses the late write
    of a deposed owner, e.g. a handler call its process was frozen inside past its lease
    while RabbitMQ had already served the partition to the next owner (README, Limits).
    0 where there is no claim (a message built outside the daemon).

    ``key`` and ``published_ms`` are None for a message without partq headers (a
    foreign publisher's); such messages are handled like any other. Spark-published
    messages carry ``partq-query-id``/``partq-batch-id``/``partq-seq`` headers and a
    deterministic ``message_id``: deduplicate replays on it.
    """

    stream: str
    partition: int
    key: str | bytes | None
    body: bytes
    message_id: str | None
    headers: Mapping[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    attempt: int = 1
    published_ms: int | None = None
    delivery_count: int = 0
    # The partition its publisher computed (``partq-partition``); differs from
    # ``partition`` only for a message published into the wrong queue.
    published_partition: int | None = None
    fencing_token: int = 0

    @property
    def replay(self) -> ReplayId | None:
        """For a Spark-published message, its (query, batch, partition, seq); else None.

        A replayed micro-batch repeats the same ids: drop ``message_id``s you have
        handled to get effectively-once.
        """
        h = self.headers
        if HEADER_QUERY_ID not in h or HEADER_BATCH_ID not in h or HEADER_SEQ not in h:
            return None
        query = h[HEADER_QUERY_ID]
        query_id = query.decode() if isinstance(query, bytes) else str(query)
        return ReplayId(query_id, int(h[HEADER_BATCH_ID]), self.partition, int(h[HEADER_SEQ]))


Handler = Callable[[Message], object]


def message_from(
    stream: str,
    partition: int,
    body: bytes,
    message_id: str | None,
    headers: Mapping[str, Any] | None,
    redelivered: bool,
    attempt: int,
    fencing_token: int = 0,
) -> Message:
    """The handler's view of one delivery; raises :class:`MalformedHeaders`.

    Every ``partq-*`` header present must parse: ``partq-key`` a UTF-8 string,
    ``partq-key-b64`` strict base64, ``partq-partition``, ``partq-published-ms``,
    ``partq-batch-id`` and ``partq-seq`` non-negative integers (a decimal string
    is accepted), ``partq-query-id`` a string. Absent headers are fine.
    """
    headers = dict(headers or {})
    _text(headers, HEADER_QUERY_ID)
    _integer(headers, HEADER_BATCH_ID)
    _integer(headers, HEADER_SEQ)
    return Message(
        stream=stream,
        partition=partition,
        key=_key(headers),
        body=body,
        message_id=message_id,
        headers=headers,
        redelivered=redelivered,
        attempt=attempt,
        published_ms=_integer(headers, HEADER_PUBLISHED_MS),
        delivery_count=_delivery_count(headers),
        published_partition=_integer(headers, HEADER_PARTITION),
        fencing_token=fencing_token,
    )


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _key(headers: Mapping[str, Any]) -> str | bytes | None:
    """As :func:`partq.producer.contract.decode_key`, but strict: a bad value raises."""
    if HEADER_KEY in headers:
        return _text(headers, HEADER_KEY)
    if HEADER_KEY_B64 in headers:
        value = headers[HEADER_KEY_B64]
        try:
            text = value.decode("ascii") if isinstance(value, bytes) else value
            if not isinstance(text, str):
                raise TypeError
            return base64.b64decode(text, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise MalformedHeaders(HEADER_KEY_B64, value, "base64") from None
    return None


def _text(headers: Mapping[str, Any], name: str) -> str | None:
    if name not in headers:
        return None
    value = headers[name]
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):  # pika gives a long string that is not UTF-8 as bytes
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise MalformedHeaders(name, value, "a UTF-8 string")


def _integer(headers: Mapping[str, Any], name: str) -> int | None:
    if name not in headers:
        return None
    value = headers[name]
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        number = int(value)
    elif isinstance(value, str | bytes):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        number = int(text) if text.isascii() and text.isdecimal() else None
    if number is None or number < 0:
        raise MalformedHeaders(name, value, "a non-negative integer")
    return number


def _delivery_count(headers: Mapping[str, Any]) -> int:
    """The broker's count; a value that is no count (a foreign header on a classic queue) is 0."""
    value = headers.get(HEADER_DELIVERY_COUNT, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def check_handler(handler: object, name: str = "") -> Handler:
    """``handler`` if partq can call it: a callable, sync or ``async def`` (a coroutine it
    returns is awaited on the daemon's event loop), but not a generator function, sync or
    async (nor a callable object or ``functools.partial`` of one): calling it only makes a
    generator, its body unrun, instead of handling one message, so it is a
    :class:`UsageError` at start."""
    shown = name or _name(handler)
    if not callable(handler):
        raise UsageError(f"the handler {shown} is not callable")
    target: object = handler
    while isinstance(target, functools.partial):
        target = target.func
    calls = [target]
    if not inspect.isroutine(target) and not inspect.isclass(target):
        calls.append(type(target).__call__)  # a callable object's method
    if any(inspect.isasyncgenfunction(c) for c in calls):
        raise UsageError(
            f"the handler {shown} is an async generator (async def with yield): give a "
            "function, sync or async def, that handles one message and returns"
        )
    if any(inspect.isgeneratorfunction(c) for c in calls):
        raise UsageError(
            f"the handler {shown} is a generator (def with yield): its body would never run; "
            "give a function, sync or async def, that handles one message and returns"
        )
    return handler


def _name(handler: object) -> str:
    name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    return f"{getattr(handler, '__module__', None) or '?'}:{name}"


def load_handler(spec: str) -> Handler:
    """``"pkg.module:function"`` → the function."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"handler {spec!r} must look like pkg.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import handler module {module_name!r}: {e}") from None
    except SyntaxError as e:  # the user's code (or a module it imports): not partq's failure
        raise UsageError(
            f"handler module {module_name!r} has a syntax error at line {e.lineno}: {e.msg} "
            f"({e.filename}): fix it and start again"
        ) from None
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise UsageError(f"{module_name!r} has no callable {attr!r}")
    return check_handler(handler, spec)
