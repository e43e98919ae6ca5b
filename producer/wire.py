"""What goes on the wire for one publish: its properties, checked, and its AMQP frames.

The SDK's caller thread encodes a message's content-header properties once
(:func:`partq.producer.topology.encoded_properties` for partq's own headers, or
:func:`encode_properties`, pika's encoder with a reason for every refusal); its
I/O thread then frames the message with :class:`Framer`: the ``Basic.Publish``
method frame (made by pika once per routing key), the content header and the body
frames, byte for byte what pika's ``Channel.basic_publish`` writes
(``tests/unit/test_wire.py`` pins the equality), without pika's per-message
objects, and hands a whole batch to the connection's transport in one write.
:class:`ConfirmingConnection` hands the broker's confirms straight back to the SDK.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

import pika
import pika.data
import pika.frame
import pika.spec
from pika.adapters.select_connection import SelectConnection

from partq.kernel.errors import PublishFailed, UsageError

__all__ = [
    "HEADER_FRAME_OVERHEAD",
    "ConfirmingConnection",
    "Framer",
    "body_refused",
    "encode_properties",
    "frame_refused",
]

# A header frame is 7 bytes of frame header, then class, weight and body size (12 bytes),
# then the encoded properties, then the frame-end byte: the properties get frame_max - 20.
HEADER_FRAME_OVERHEAD = 20
_SHORT_STRING_MAX = 255
_FRAME_END = bytes((pika.spec.FRAME_END,))
_BODY_FRAME = struct.Struct(">BHI")  # frame type 3, channel, payload size
# frame type 2, channel, payload size; class 60 (basic), weight 0, body size
_HEADER_FRAME = struct.Struct(">BHIHHQ")
_HEADER_PAYLOAD_PREFIX = 12  # class, weight and body size, ahead of the properties
_NON_BODY = pika.spec.FRAME_HEADER_SIZE + pika.spec.FRAME_END_SIZE  # what a frame adds


class ConfirmingConnection(SelectConnection):  # type: ignore[misc]
    """A ``SelectConnection`` that hands publisher confirms (``Basic.Ack``/``Basic.Nack``
    on the channel given to :meth:`route_confirms`) straight to one function.

    pika dispatches every inbound method frame through its callback registry (several
    decorators, a lookup by channel and method class); profiled on a classic queue,
    which confirms about one message per frame, that took about 10 % of the SDK's CPU,
    nearly as much as the SDK's own handling of the confirm. The broker sends
    ``Basic.Ack``/``Nack`` to a client only as publisher confirms; every other frame goes
    through pika as before, and the channel still enables confirms with
    ``confirm_delivery``.
    """

    _confirm_channel = -1
    _on_confirm: Callable[[pika.frame.Method], None] | None = None

    def route_confirms(
        self, channel_number: int, on_confirm: Callable[[pika.frame.Method], None]
    ) -> None:
        self._confirm_channel = channel_number
        self._on_confirm = on_confirm

    def _process_frame(self, frame_value: Any) -> None:
        method = getattr(frame_value, "method", None)
        kind = type(method)
        if (
            (kind is pika.spec.Basic.Ack or kind is pika.spec.Basic.Nack)
            and frame_value.channel_number == self._confirm_channel
            and self._on_confirm is not None
        ):
            self.frames_received += 1  # as pika counts every frame it processes
            self._on_confirm(frame_value)
            return
        super()._process_frame(frame_value)


class Framer:
    """Frames ``mandatory`` ``Basic.Publish`` messages to one exchange on one channel.

    The I/O thread's per-message work: a cached method frame, one ``struct`` pack for
    the content header, one for each body frame. :meth:`send` writes what
    :meth:`add` collected to the connection in one piece (pika's transport buffers it
    and sends it when the socket is writable, as it does its own frames).
    """

    def __init__(self, connection: SelectConnection, channel_number: int, exchange: str) -> None:
        self._connection = connection
        self._channel = channel_number
        self._exchange = exchange
        self._body_max = connection.params.frame_max - _NON_BODY
        self._methods: dict[str, bytes] = {}
        self._out: list[bytes] = []
        self._frames = 0

    def add(self, routing_key: str, properties: bytes, body: bytes) -> None:
        """Frame one message (the connection sees it at :meth:`send`)."""
        out, channel = self._out, self._channel
        method = self._methods.get(routing_key)
        if method is None:
            publish = pika.spec.Basic.Publish(
                exchange=self._exchange, routing_key=routing_key, mandatory=True
            )
            method = self._methods[routing_key] = pika.frame.Method(channel, publish).marshal()
        size = len(body)
        out.append(method)
        out.append(
            _HEADER_FRAME.pack(2, channel, _HEADER_PAYLOAD_PREFIX + len(properties), 60, 0, size)
        )
        out.append(properties)
        out.append(_FRAME_END)
        if size <= self._body_max:
            if size:
                out.append(_BODY_FRAME.pack(3, channel, size))
                out.append(body)
                out.append(_FRAME_END)
                self._frames += 3
            else:
                self._frames += 2
            return
        self._frames += 2
        for start in range(0, size, self._body_max):
            chunk = body[start : start + self._body_max]
            out.append(_BODY_FRAME.pack(3, channel, len(chunk)))
            out.append(chunk)
            out.append(_FRAME_END)
            self._frames += 1

    def send(self) -> None:
        """Hand every frame added since the last call to the connection, in one write."""
        if not self._out:
            return
        data = b"".join(self._out)
        self._out.clear()
        connection = self._connection
        connection.bytes_sent += len(data)  # pika's own counters, as its frames update them
        connection.frames_sent += self._frames
        self._frames = 0
        connection._adapter_emit_data(data)


# -- what AMQP can carry (the caller's thread; the slow paths only run for a bad message) ----


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


def body_refused(size: int, limit: int) -> PublishFailed:
    return PublishFailed(
        f"the broker refused the message: its body of {size} bytes is above the broker's "
        f"max_message_size of {limit} bytes: split it, or raise max_message_size in "
        f"rabbitmq.conf"
    )


def frame_refused(size: int, limit: int) -> PublishFailed:
    return PublishFailed(
        f"the broker refused the message: its key (sent as a header), headers and message_id "
        f"take {size} bytes encoded, more than the {limit} that fit one AMQP frame with the "
        f"broker's frame_max of {limit + HEADER_FRAME_OVERHEAD} (frame too large): use a "
        f"shorter key or carry large values in the body"
    )


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
