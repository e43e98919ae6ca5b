"""The wire contract: the hash against the golden vectors, names, the spec."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partq.producer import (
    InvalidStreamName,
    SpecMismatch,
    StreamSpec,
    UsageError,
    partition_for,
    queue_name,
    queue_pattern,
)
from partq.producer.contract import (
    HEADER_CONTROL,
    HEADER_KEY,
    HEADER_KEY_B64,
    HEADER_PARTITION,
    HEADER_PUBLISHED_MS,
    decode_key,
    encode_key,
)
from partq.producer.properties import encoded_properties, message_properties


def _key(vector: dict[str, Any]) -> str | bytes:
    return vector["key"] if "key" in vector else bytes.fromhex(vector["key_hex"])


def test_every_golden_vector(partition_vectors: dict[str, Any]) -> None:
    # Given the shared golden vectors
    vectors = partition_vectors["vectors"]
    assert len(vectors) >= 20
    checked = 0
    for vector in vectors:
        key = _key(vector)
        for partitions, expected in vector["partition"].items():
            # When a key is hashed into P partitions / Then it lands where the vectors say
            assert partition_for(key, int(partitions)) == expected, (key, partitions)
            checked += 1
        assert partition_for(key, 2**32) == vector["murmur3_x86_32"]
    assert checked > 100


def test_str_key_hashes_as_its_utf8_bytes() -> None:
    assert partition_for("Ünïcødé", 1000) == partition_for("Ünïcødé".encode(), 1000)
    assert partition_for(bytearray(b"abc"), 7) == partition_for(b"abc", 7)


@pytest.mark.parametrize("key", [None, 42, 4.2, ["a"], object()])
def test_other_key_types_are_type_errors(key: object) -> None:
    with pytest.raises(TypeError, match="str or bytes"):
        partition_for(key, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("partitions", [0, -1])
def test_partitions_below_one_are_value_errors(partitions: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        partition_for("k", partitions)


def test_queue_names_match_their_stream_pattern_only() -> None:
    pattern = re.compile(queue_pattern("orders"))
    assert queue_name("orders", 7) == "partq.orders.p00007"
    assert pattern.match(queue_name("orders", 65_535))
    assert not pattern.match(queue_name("orders.x", 7))
    assert not pattern.match(queue_name("orders2", 7))
    assert not pattern.match("partq.orders.dlq")


@pytest.mark.parametrize("name", ["", "Orders", "-x", "a b", "a/b", "x" * 101, "ä"])
def test_invalid_stream_names_show_the_allowed_form(name: str) -> None:
    with pytest.raises(InvalidStreamName, match=r"\[a-z0-9\]\[a-z0-9_.-\]\*"):
        StreamSpec(name, 4)


def test_spec_validates_and_round_trips() -> None:
    spec = StreamSpec("orders.eu-1", 16, "classic")
    assert StreamSpec.from_json(spec.to_json()) == spec
    assert spec.queue(15) == "partq.orders.eu-1.p00015"
    with pytest.raises(ValueError):
        spec.queue(16)
    for bad in (0, 65_537):
        with pytest.raises(UsageError, match="between 1 and 65536"):
            StreamSpec("s", bad)
    with pytest.raises(UsageError, match="quorum, classic"):
        StreamSpec("s", 4, "stream")  # type: ignore[arg-type]


def test_configured_partitions_must_match_the_spec() -> None:
    spec = StreamSpec("orders", 16)
    spec.check_partitions(None)
    spec.check_partitions(16)
    with pytest.raises(SpecMismatch, match="16 partitions in etcd, but 8"):
        spec.check_partitions(8)


@pytest.mark.parametrize("key", ["user-1", "", "ключ", b"\x00\xff", b"plain"])
def test_keys_round_trip_through_headers_with_their_type(key: str | bytes) -> None:
    assert decode_key(encode_key(key)) == key


@settings(max_examples=400, deadline=None)
@given(
    key=st.one_of(st.text(max_size=300), st.binary(max_size=200)),
    partition=st.integers(min_value=0, max_value=2**40),
    message_id=st.text(max_size=300),
    now=st.one_of(st.floats(min_value=0, max_value=4e9), st.sampled_from([0.0, 2**31 / 1000])),
)
def test_the_sdks_own_property_encoder_gives_pikas_bytes(
    key: str | bytes, partition: int, message_id: str, now: float
) -> None:
    # Given any key, partition, message id and time, when the fast encoder answers,
    # then it gives exactly the bytes pika's encoder gives for the same properties
    fast = encoded_properties(key, partition, message_id, now)
    try:
        props = message_properties(key, partition, message_id=message_id, now=now)
        pikas = b"".join(props.encode())
    except Exception:  # pika refuses (e.g. a message id over 255 bytes): so must we
        assert fast is None
        return
    if fast is not None:
        assert fast == pikas
    else:  # declined only where pika's answer needs pika
        mid = message_id.encode("utf-8", "surrogatepass")
        assert not mid or len(mid) > 255 or not _utf8(key)


def _utf8(key: str | bytes) -> bool:
    try:
        key.encode() if isinstance(key, str) else b""
    except UnicodeEncodeError:
        return False
    return True


def test_replicas_are_stored_and_declared_for_quorum_streams_only() -> None:
    from partq.producer.queue_arguments import park_queue_arguments, queue_arguments

    from partq.kernel.errors import UsageError

    spec = StreamSpec("s", 4, "quorum", replicas=3)
    assert StreamSpec.from_json(spec.to_json()) == spec
    assert queue_arguments(spec)["x-quorum-initial-group-size"] == 3
    assert park_queue_arguments(spec)["x-quorum-initial-group-size"] == 3
    assert "x-quorum-initial-group-size" not in queue_arguments(StreamSpec("s", 4, "quorum"))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UsageError, match="replicas"):
            StreamSpec("s", 4, "quorum", replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="quorum queues only"):
        StreamSpec("s", 4, "classic", replicas=2)


_HEADER_VALUES = st.one_of(
    st.text(max_size=50),
    st.binary(max_size=20),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False),
    st.none(),
)


@settings(max_examples=400, deadline=None)
@given(
    key=st.one_of(st.text(max_size=40), st.binary(max_size=40)),
    partition=st.integers(min_value=0, max_value=2**40),
    headers=st.dictionaries(
        st.one_of(st.text(max_size=300), st.sampled_from([HEADER_PARTITION, "partq-key"])),
        _HEADER_VALUES,
        max_size=5,
    ),
)
def test_the_fast_encoder_with_user_headers_gives_pikas_bytes(
    key: str | bytes, partition: int, headers: dict[str, Any]
) -> None:
    # Given user headers of any name and value (the Spark sink's replay headers are
    # str and int), when the fast encoder answers, then it gives pika's bytes
    fast = encoded_properties(key, partition, "id-1", 1_700_000_000.5, headers)
    try:
        props = message_properties(
            key, partition, message_id="id-1", headers=headers, now=1_700_000_000.5
        )
        pikas = b"".join(props.encode())
    except Exception:
        assert fast is None
        return
    if fast is not None:
        assert fast == pikas
    else:  # declined only for what it does not encode itself
        assert not _utf8(key) or any(
            not _fast_header(name, value) for name, value in headers.items()
        )


def _fast_header(name: str, value: Any) -> bool:
    # partq's own names, the control header among them, go to pika's path
    partqs = {HEADER_KEY, HEADER_KEY_B64, HEADER_PARTITION, HEADER_PUBLISHED_MS, HEADER_CONTROL}
    if name in partqs or not _utf8(name) or len(name.encode()) > 255:
        return False
    if type(value) is int:
        return -(2**63) <= value < 2**63
    return type(value) in (bytes, bool) or (type(value) is str and _utf8(value))


def test_the_spark_replay_headers_take_the_fast_path() -> None:
    # Given the headers every Spark-published message carries
    headers = {"partq-query-id": "q-1", "partq-batch-id": 7, "partq-seq": 12}
    # Then the fast encoder answers them, with pika's bytes
    fast = encoded_properties("user-1", 3, "id-1", 1_700_000_000.0, headers)
    props = message_properties("user-1", 3, message_id="id-1", headers=headers, now=1.7e9)
    assert fast is not None and fast == b"".join(props.encode())
