"""The SDK frames a publish exactly as pika's ``Channel.basic_publish`` would (no broker)."""

from __future__ import annotations

from typing import Any

import pika
import pika.connection
import pika.frame
import pika.spec
import pytest
from partq.producer.properties import encoded_properties
from partq.producer.wire import ConfirmingConnection, Framer

FRAME_MAX = 4096


class _Connection:
    """What the framer uses of a connection, recording what it is given."""

    def __init__(self) -> None:
        self.params = pika.ConnectionParameters(frame_max=FRAME_MAX)
        self.bytes_sent = 0
        self.frames_sent = 0
        self.written: list[bytes] = []

    def _adapter_emit_data(self, data: bytes) -> None:
        self.written.append(data)


class _PikaRecorder:
    """pika's own framing (``Connection._send_message``), its output recorded."""

    _send_message = pika.connection.Connection._send_message
    _output_marshaled_frames = pika.connection.Connection._output_marshaled_frames

    def __init__(self) -> None:  # only what those two read
        self._body_max_length = FRAME_MAX - 8
        self.bytes_sent = 0
        self.frames_sent = 0
        self.written: list[bytes] = []

    def _adapter_emit_data(self, data: bytes) -> None:
        self.written.append(data)


def pikas_frames(channel: int, exchange: str, routing_key: str, props: bytes, body: bytes) -> Any:
    recorder = _PikaRecorder()
    properties = pika.BasicProperties()
    properties.encode = lambda: [props]
    method = pika.spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True)
    recorder._send_message(channel, method, (properties, body))
    return recorder


@pytest.mark.parametrize("size", [0, 1, 200, FRAME_MAX - 8, FRAME_MAX - 7, 3 * FRAME_MAX + 5])
def test_frames_are_pikas_bytes_for_every_body_size(size: int) -> None:
    # Given messages with bodies around the body-frame limit (none, one, several frames)
    props = encoded_properties("user-1", 5, "id-1", 1_700_000_000.0)
    assert props is not None
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    connection = _Connection()
    framer = Framer(connection, 3, "orders")  # type: ignore[arg-type]
    # When the framer frames two of them and sends the batch
    framer.add("5", props, body)
    framer.add("5", props, body)
    framer.send()
    # Then it wrote, in one piece, what pika writes for the two, and counted as pika does
    pika_ = pikas_frames(3, "orders", "5", props, body)
    assert connection.written == [b"".join(pika_.written) * 2]
    assert connection.bytes_sent == 2 * pika_.bytes_sent
    assert connection.frames_sent == 2 * pika_.frames_sent
    # And nothing more is written until more is added
    framer.send()
    assert len(connection.written) == 1


def test_each_routing_key_gets_its_own_method_frame() -> None:
    props = b"\x00\x00"
    connection = _Connection()
    framer = Framer(connection, 1, "s")  # type: ignore[arg-type]
    for key in ("0", "7", "0"):
        framer.add(key, props, b"x")
    framer.send()
    expected = b"".join(
        b"".join(pikas_frames(1, "s", key, props, b"x").written) for key in ("0", "7", "0")
    )
    assert connection.written == [expected]


def test_confirms_on_the_routed_channel_skip_pikas_registry_and_the_rest_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a connection routing channel 1's confirms to a function
    seen: list[object] = []
    passed: list[object] = []
    connection = ConfirmingConnection.__new__(ConfirmingConnection)  # no socket
    connection.frames_received = 0
    connection.route_confirms(1, seen.append)
    monkeypatch.setattr(
        pika.connection.Connection, "_process_frame", lambda _self, f: passed.append(f)
    )
    ack = pika.frame.Method(1, pika.spec.Basic.Ack(delivery_tag=5, multiple=True))
    nack = pika.frame.Method(1, pika.spec.Basic.Nack(delivery_tag=6))
    other_channel = pika.frame.Method(2, pika.spec.Basic.Ack(delivery_tag=1))
    deliver = pika.frame.Method(1, pika.spec.Basic.Deliver())
    heartbeat = pika.frame.Heartbeat()
    # When frames of each kind arrive
    for frame in (ack, nack, other_channel, deliver, heartbeat):
        connection._process_frame(frame)
    # Then the channel's acks and nacks went to the function, everything else to pika
    assert seen == [ack, nack]
    assert passed == [other_channel, deliver, heartbeat]
    assert connection.frames_received == 2
