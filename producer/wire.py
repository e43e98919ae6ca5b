"""What goes on the wire for one publish: its AMQP frames, and what the broker takes.

The SDK's caller thread encodes a message's content-header properties once
(:mod:`partq.producer.properties`); its
I/O thread then frames the message with :class:`Framer`: the ``Basic.Publish``
method frame (made by pika once per routing key), the content header and the body
frames, byte for byte what pika's ``Channel.basic_publish`` writes
(``tests/unit/test_wire.py`` pins the equality), without pika's per-message
objects, and hands a whole batch to the connection's transport in one write.
:class:`ConfirmingConnection` hands the broker's confirms straight back to the SDK.
:class:`Limits` holds what the broker takes of one message, and ``body_limit`` and
``frame_limit`` read a limit out of the broker's refusal of a message above it.

Threads. The producer's I/O thread makes and uses the connection and its ``Framer``, and
writes ``Limits``; any thread reads ``Limits`` without a lock (one value each: a stale
limit only means the broker refuses the message).
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pika.frame
import pika.spec
from pika.adapters.select_connection import SelectConnection

from partq.kernel.errors import PublishFailed

__all__ = [
    "HEADER_FRAME_OVERHEAD",
    "ConfirmingConnection",
    "Framer",
    "Limits",
    "body_limit",
    "body_refused",
    "frame_limit",
    "frame_refused",
]

# A header frame is 7 bytes of frame header, then class, weight and body size (12 bytes),
# then the encoded properties, then the frame-end byte: the properties get frame_max - 20.
HEADER_FRAME_OVERHEAD = 20
_FRAME_END = bytes((pika.spec.FRAME_END,))
_BODY_FRAME = struct.Struct(">BHI")  # frame type 3, channel, payload size
# frame type 2, channel, payload size; class 60 (basic), weight 0, body size
_HEADER_FRAME = struct.Struct(">BHIHHQ")
_HEADER_PAYLOAD_PREFIX = 12  # class, weight and body size, ahead of the properties
_NON_BODY = pika.spec.FRAME_HEADER_SIZE + pika.spec.FRAME_END_SIZE  # what a frame adds
# How RabbitMQ refuses a body above max_message_size (it closes the channel, 406) and a
# frame above frame_max (it closes the connection, 501; the numbers are payload sizes).
_BODY_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")
_FRAME_TOO_LARGE = re.compile(r"frame_too_large,\s*(\d+),\s*(\d+)")


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


@dataclass(slots=True)
class Limits:
    """What the broker takes of one message: encoded properties larger than ``properties``
    do not fit one header frame (the negotiated frame_max replaces the requested one on
    connect); bodies larger than ``body`` are refused (the broker tells its
    max_message_size when it refuses one)."""

    properties: int
    body: int = sys.maxsize


def body_limit(refusal: str) -> int | None:
    """The broker's max_message_size, if ``refusal`` (a channel's close text) refused a body."""
    found = _BODY_TOO_LARGE.search(refusal)
    return None if found is None else int(found.group(2))


def frame_limit(refusal: str) -> int | None:
    """The bytes of properties one header frame takes, if ``refusal`` (a connection's close
    text) refused a frame above frame_max."""
    found = _FRAME_TOO_LARGE.search(refusal)
    return None if found is None else int(found.group(2)) - _HEADER_PAYLOAD_PREFIX


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
