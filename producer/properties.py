"""A message's AMQP properties: the one module that builds and encodes them.

Every publish of the SDK carries the same properties (``message_properties``): persistent,
``app_id`` partq, a ``message_id``, a timestamp, and the headers of the key
(``x-partq-key`` or ``x-partq-key-b64``), the partition and the publish time, next to the
caller's own. :func:`encoded_properties` builds their bytes directly, the SDK's hot path;
:func:`encode_properties` is pika's encoder, with a reason for every refusal, for what the
fast path leaves to it. :func:`properties_for` is the one way the producer encodes a message
(first in the caller's thread, again in the I/O thread when a resize moves it to another
partition); ``tests/unit/test_contract.py`` pins the equality of the two encoders.

Threads. Nothing here holds state: the functions run on whichever thread calls them (the
caller of ``publish``, the producer's I/O thread, the CLI's ``partq produce``).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

import pika
import pika.data
from partq.producer.contract import (
    HEADER_CONTROL,
    HEADER_KEY,
    HEADER_KEY_B64,
    HEADER_PARTITION,
    HEADER_PUBLISHED_MS,
    encode_key,
    refuse_control_headers,
)
from partq.producer.wire import HEADER_FRAME_OVERHEAD

from partq.kernel.errors import UsageError

__all__ = ["encode_properties", "encoded_properties", "message_properties", "properties_for"]

_SHORT_STRING_MAX = 255

_FLAGS = struct.pack(
    ">H",
    pika.BasicProperties.FLAG_HEADERS
    | pika.BasicProperties.FLAG_DELIVERY_MODE
    | pika.BasicProperties.FLAG_MESSAGE_ID
    | pika.BasicProperties.FLAG_TIMESTAMP
    | pika.BasicProperties.FLAG_APP_ID,
)
_KEY = bytes([len(HEADER_KEY)]) + HEADER_KEY.encode() + b"S"
_KEY_B64 = bytes([len(HEADER_KEY_B64)]) + HEADER_KEY_B64.encode() + b"S"
_PARTITION = bytes([len(HEADER_PARTITION)]) + HEADER_PARTITION.encode()
_PUBLISHED = bytes([len(HEADER_PUBLISHED_MS)]) + HEADER_PUBLISHED_MS.encode()
_APP_ID = b"\x05partq"
_DELIVERY_MODE = b"\x02"  # persistent
_INT32 = struct.Struct(">ci")  # pika's table int: 'I' if it fits 32 bits, else 'l'
_INT64 = struct.Struct(">cq")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def _table_int(value: int) -> bytes:
    return _INT32.pack(b"I", value) if -(2**31) <= value < 2**31 else _INT64.pack(b"l", value)


# partq's own header names: the fast encoder leaves them to pika's path (for the control
# header, to the refusal in :func:`properties_for`)
_RESERVED = frozenset(
    (HEADER_KEY, HEADER_KEY_B64, HEADER_PARTITION, HEADER_PUBLISHED_MS, HEADER_CONTROL)
)
_LONG_STRING = struct.Struct(">cI")
_BOOL = {True: b"t\x01", False: b"t\x00"}


def _table_entries(headers: Mapping[str, Any]) -> list[bytes] | None:
    """``headers`` as pika encodes a table's entries, for names that are short strings
    (not partq's own) and values that are str, bytes, bool or 64-bit int; else None."""
    pieces: list[bytes] = []
    for name, value in headers.items():
        if type(name) is not str or name in _RESERVED:
            return None
        encoded_name = name.encode()
        if len(encoded_name) > 255:
            return None
        pieces.append(bytes((len(encoded_name),)))
        pieces.append(encoded_name)
        kind = type(value)
        if kind is str:
            data = value.encode()
            pieces.append(_LONG_STRING.pack(b"S", len(data)))
            pieces.append(data)
        elif kind is bytes:
            pieces.append(_LONG_STRING.pack(b"x", len(value)))
            pieces.append(value)
        elif kind is bool:
            pieces.append(_BOOL[value])
        elif kind is int and -(2**63) <= value < 2**63:
            pieces.append(_table_int(value))
        else:
            return None
    return pieces


def encoded_properties(
    key: str | bytes,
    partition: int,
    message_id: str,
    now: float,
    headers: Mapping[str, Any] | None = None,
) -> bytes | None:
    """The bytes pika encodes for ``message_properties(key, partition,
    message_id=message_id, headers=headers, now=now)``, built directly: the SDK's hot
    path. None where only pika's own encoder gives the exact answer (then use it):
    an empty message id (pika's path makes one up) or one over 255 bytes, a key that is
    not valid text, a partition outside a 32-bit int, a header named as partq's own or
    whose value is not a str, bytes, bool or 64-bit int (exactly those types: a
    subclass may encode otherwise). ``tests/unit/test_contract.py`` pins the equality."""
    try:
        mid = message_id.encode()
        value = key.encode() if isinstance(key, str) else base64.b64encode(key)
        extra = _table_entries(headers) if headers else []
    except (UnicodeEncodeError, TypeError, AttributeError):
        return None
    if extra is None:
        return None
    if not mid or len(mid) > 255 or not 0 <= now < 2**63 / 1000 or not 0 <= partition < 2**63:
        return None
    table = b"".join(
        (
            *extra,
            _KEY if isinstance(key, str) else _KEY_B64,
            _U32.pack(len(value)),
            value,
            _PARTITION,
            _table_int(partition),
            _PUBLISHED,
            _table_int(int(now * 1000)),
        )
    )
    return b"".join(
        (
            _FLAGS,
            _U32.pack(len(table)),
            table,
            _DELIVERY_MODE,
            bytes([len(mid)]),
            mid,
            _U64.pack(int(now)),
            _APP_ID,
        )
    )


def message_properties(
    key: str | bytes,
    partition: int,
    *,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> pika.BasicProperties:
    """Persistent message properties carrying key, partition, message id and timestamp."""
    stamp = time.time() if now is None else now
    merged: dict[str, Any] = dict(headers or {})
    merged.update(encode_key(key))
    merged[HEADER_PARTITION] = partition
    merged[HEADER_PUBLISHED_MS] = int(stamp * 1000)
    return pika.BasicProperties(
        delivery_mode=2,
        message_id=message_id or uuid.uuid4().hex,
        timestamp=int(stamp),
        headers=merged,
        app_id="partq",
    )


def encode_properties(properties: Any, limit: int) -> bytes:
    """``properties`` encoded as pika would send them: the SDK sends these bytes as they are.

    Raises :class:`UsageError` for what pika cannot encode, or for more than ``limit`` bytes
    (what one header frame carries): in the I/O thread the first would end the thread and
    the second would make the broker close the connection, again at every republish.
    """
    try:
        encoded = b"".join(properties.encode())
    except Exception as e:  # struct.error, pika's own, AssertionError, UnicodeEncodeError …
        raise UsageError(f"cannot publish this message: {_unencodable(properties, e)}") from None
    if len(encoded) > limit:
        raise UsageError(
            f"cannot publish this message: its key (sent as a header), headers and message_id "
            f"take {len(encoded)} bytes encoded, more than the {limit} that fit one AMQP frame "
            f"with this connection's frame_max of {limit + HEADER_FRAME_OVERHEAD}: use a shorter "
            f"key (e.g. a hash of a long id) or carry large values in the body"
        )
    return encoded


def _unencodable(properties: Any, error: Exception) -> str:
    """Why pika could not encode ``properties``: which field, what is wrong, what to do."""
    message_id = properties.message_id
    problem = _short_string_problem(f"message_id {_short(message_id)}", message_id)
    if problem is None and properties.headers is not None:
        problem = _table_problem(properties.headers, "")
    return problem or f"pika cannot encode its properties ({type(error).__name__}: {error})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}…"


def _short_string_problem(what: str, value: Any) -> str | None:
    """What is wrong with ``value`` (described as ``what``) as an AMQP short string, if anything."""
    if value is None:
        return None
    if not isinstance(value, str | bytes):
        return f"{what} must be a str, not {type(value).__name__}"
    try:
        size = len(value.encode("utf-8")) if isinstance(value, str) else len(value)
    except UnicodeEncodeError:
        return f"{what} is not valid UTF-8 text (it holds a lone surrogate)"
    if size > _SHORT_STRING_MAX:
        return (
            f"{what} is {size} bytes in UTF-8, more than the {_SHORT_STRING_MAX} an AMQP "
            f"short string holds: make it shorter"
        )
    return None


def _table_problem(table: Mapping[Any, Any], path: str) -> str | None:
    for name, value in table.items():
        what = f"header {path} has key {_short(name)}" if path else f"header key {_short(name)}"
        problem = _short_string_problem(what, name)
        if problem is None:
            problem = _value_problem(value, f"{path}[{name!r}]" if path else repr(name))
        if problem is not None:
            return problem
    return None


def _value_problem(value: Any, path: str) -> str | None:
    if isinstance(value, dict):
        return _table_problem(value, path)
    if isinstance(value, list):
        for index, item in enumerate(value):
            problem = _value_problem(item, f"{path}[{index}]")
            if problem is not None:
                return problem
        return None
    try:
        pika.data.encode_value([], value)
        return None
    except Exception:
        return _unsendable(value, path)


def _unsendable(value: Any, path: str) -> str:
    """Why pika cannot encode ``value`` (a header at ``path``), and what to send instead."""
    what = f"header {path}"
    kind = type(value).__name__
    if isinstance(value, str):
        return f"{what} is not valid UTF-8 text (it holds a lone surrogate): fix it, or send bytes"
    if isinstance(value, int):
        return (
            f"{what} is {value}, outside AMQP's signed 64-bit integers "
            f"(-2**63 … 2**63-1): send it as a str"
        )
    if isinstance(value, float):
        return f"{what} is a float ({value!r}), which pika cannot send: send a str or a Decimal"
    if isinstance(value, Decimal):
        return (
            f"{what} is Decimal({str(value)!r}), which an AMQP decimal cannot hold (a finite "
            f"signed 32-bit integer scaled by at most 255 decimal places): send it as a str"
        )
    if isinstance(value, datetime):
        return (
            f"{what} is {value.isoformat()}: AMQP timestamps are whole seconds from 1970 on "
            f"(unsigned 64-bit): send it as a str"
        )
    if isinstance(value, tuple | set | frozenset):
        return f"{what} is a {kind}: an AMQP array is a list: send list(...)"
    if isinstance(value, bytearray | memoryview):
        return f"{what} is a {kind}: send bytes(...)"
    return (
        f"{what} is a {kind}, which an AMQP header cannot carry: use str, bytes, bool, int, "
        f"Decimal, datetime, None, or a dict or list of those"
    )


def properties_for(
    key: str | bytes,
    partition: int,
    message_id: str,
    now: float,
    headers: Mapping[str, Any] | None,
    limit: int,
    *,
    refuse_control: bool = True,
) -> tuple[bytes, str]:
    """A publish's properties encoded (at most ``limit`` bytes: one header frame), and its
    message id: the fast encoder's bytes, else pika's (which makes one up for an empty id).

    Raises :class:`UsageError` for what AMQP cannot carry, and (``refuse_control``) for
    partq's control header; a message moved to another partition was checked when it was
    first encoded (``refuse_control=False``).
    """
    encoded = encoded_properties(key, partition, message_id, now, headers)
    if encoded is not None and len(encoded) <= limit:
        return encoded, message_id
    # pika's own encoder: headers it alone encodes, or a message it refuses with a reason;
    # the fast encoder leaves partq's control header to this path
    if refuse_control:
        refuse_control_headers(headers)
    properties = message_properties(key, partition, message_id=message_id, headers=headers, now=now)
    return encode_properties(properties, limit), properties.message_id
