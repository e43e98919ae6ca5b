"""What pika's encoder cannot take is refused in the caller's thread, with a message that says
what to do; what it can take is encoded once, exactly as pika would send it (no broker)."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal
from typing import Any

import pika
import pytest
from partq.producer import UsageError
from partq.producer.contract import HEADER_KEY, HEADER_PARTITION
from partq.producer.properties import encode_properties as _encode_properties
from partq.producer.properties import message_properties

FRAME = 131_072 - 20  # what a header frame carries of properties with the default frame_max


def decoded(encoded: bytes) -> pika.BasicProperties:
    properties = pika.BasicProperties()
    properties.decode(encoded)
    return properties


def test_what_pika_can_encode_is_encoded_as_pika_would() -> None:
    # Given headers of every type an AMQP table carries, at the edges of their ranges
    headers: dict[str, Any] = {
        "str": "é" * 1000,
        "bytes": b"\x00\xff",
        "bool": True,
        "small": 7,
        "max": 2**63 - 1,
        "min": -(2**63),
        "decimal": Decimal("12.345"),
        "when": dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.UTC),
        "none": None,
        "nested": {"list": [1, "two", {"three": [b"4"]}], "k" * 255: 1},
    }
    properties = message_properties("key", 3, message_id="m" * 255, headers=headers)
    # When they are encoded
    encoded = _encode_properties(properties, FRAME)
    # Then the bytes are pika's own, and decode back to the same values
    assert encoded == b"".join(pika.BasicProperties.encode(properties))
    back = decoded(encoded)
    assert back.message_id == "m" * 255
    assert back.headers[HEADER_KEY] == "key"
    assert back.headers[HEADER_PARTITION] == 3
    for name in ("str", "bytes", "bool", "small", "max", "min", "decimal", "none"):
        assert back.headers[name] == headers[name], name
    assert back.headers["when"] == headers["when"]
    assert back.headers["nested"]["list"][2] == {"three": [b"4"]}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"n": 2**63}, ["header 'n'", "64-bit", "send it as a str"]),
        ({"n": -(2**63) - 1}, ["header 'n'", "64-bit"]),
        ({"f": 1.5}, ["header 'f'", "float", "Decimal"]),
        ({"f": float("nan")}, ["header 'f'", "float"]),
        ({"s": {"a"}}, ["header 's'", "set", "list"]),
        ({"t": (1, 2)}, ["header 't'", "tuple", "list"]),
        ({"o": object()}, ["header 'o'", "object"]),
        ({"b": bytearray(b"x")}, ["header 'b'", "bytearray", "bytes"]),
        ({"u": "\ud800"}, ["header 'u'", "UTF-8"]),
        ({"d": Decimal("NaN")}, ["header 'd'", "Decimal", "str"]),
        ({"d": Decimal(2**40)}, ["header 'd'", "Decimal", "32-bit"]),
        ({"d": Decimal("1e-300")}, ["header 'd'", "Decimal"]),
        ({"when": dt.datetime(1969, 12, 31)}, ["header 'when'", "1970"]),
        ({"k" * 256: 1}, ["header key 'kkk", "256 bytes", "255"]),
        ({"é" * 128: 1}, ["header key", "256 bytes"]),
        ({1: "a"}, ["header key 1", "str"]),
        ({"outer": {"inner": [1, 2**64]}}, ["header 'outer'['inner'][1]", "64-bit"]),
        ({"outer": {2: "x"}}, ["header 'outer' has key 2", "str"]),
        ({"outer": [{"x" * 300: 1}]}, ["header 'outer'[0] has key 'xxx", "300 bytes"]),
    ],
    # the same ids in every process (pytest-xdist compares them): no object addresses
    ids=lambda value: (
        re.sub(r" at 0x\w+", "", repr(value))[:40] if isinstance(value, dict) else None
    ),
)
def test_an_unencodable_header_is_a_usage_error_naming_it(
    headers: dict[Any, Any], expected: list[str]
) -> None:
    # Given a message whose headers pika cannot encode
    properties = message_properties("key", 0, message_id="id", headers=headers)
    # When it is encoded
    with pytest.raises(UsageError) as caught:
        _encode_properties(properties, FRAME)
    # Then the error names the header, what is wrong with it, and what to do
    message = str(caught.value)
    for part in expected:
        assert part in message, message
    assert caught.value.__cause__ is None


@pytest.mark.parametrize(
    ("message_id", "expected"),
    [
        ("m" * 256, ["message_id", "256 bytes", "255"]),
        ("é" * 128, ["message_id", "256 bytes"]),
        (42, ["message_id", "str", "int"]),
    ],
    ids=["256-ascii", "256-utf8-bytes", "int"],
)
def test_an_unencodable_message_id_is_a_usage_error(message_id: Any, expected: list[str]) -> None:
    properties = message_properties("key", 0, message_id=message_id)
    with pytest.raises(UsageError) as caught:
        _encode_properties(properties, FRAME)
    for part in expected:
        assert part in str(caught.value)


def test_properties_larger_than_a_frame_are_a_usage_error() -> None:
    # Given a key whose header alone is larger than a frame carries
    properties = message_properties("k" * 140_000, 0, message_id="id")
    # When it is encoded against the frame's limit
    with pytest.raises(UsageError) as caught:
        _encode_properties(properties, FRAME)
    # Then the error gives the sizes, frame_max, and the fix
    message = str(caught.value)
    assert "frame_max" in message
    assert "131072" in message
    assert "shorter key" in message
    # And a key that fits is accepted, up to the last byte
    fits = message_properties("k", 0, message_id="id")
    size = len(_encode_properties(fits, FRAME))
    room = FRAME - size
    exact = message_properties("k" * (1 + room), 0, message_id="id")
    assert len(_encode_properties(exact, FRAME)) == FRAME
    with pytest.raises(UsageError):
        _encode_properties(message_properties("k" * (2 + room), 0, message_id="id"), FRAME)
