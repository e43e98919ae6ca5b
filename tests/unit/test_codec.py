"""partq.coordinator.store.codec: every value partq writes to etcd round-trips; anything else is
refused.

Decoding never raises anything but ``MalformedValue`` (whatever the bytes), encoding
never produces what decoding refuses, and member ids are exactly the documented set.
"""

from __future__ import annotations

import contextlib
import json
import re
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partq.consumers.control.daemon import ConsumerConfig, default_member_id
from partq.coordinator.store import codec, kinds
from partq.coordinator.store.codec import (
    MEMBER_ID_PATTERN,
    Assignment,
    Candidate,
    Claim,
    Drain,
    Member,
    Move,
    Rebalance,
    encode_assignment,
    encode_claim,
    encode_member,
    encode_request,
    validate_member_id,
)
from partq.producer.contract import MAX_PARTITIONS, StreamSpec

from partq.kernel.errors import InvalidMemberId, MalformedValue, UsageError

STREAM = "orders"

member_ids = st.from_regex(MEMBER_ID_PATTERN, fullmatch=True)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
leases = st.integers(min_value=0, max_value=2**63 - 1)
partitions = st.integers(min_value=0, max_value=MAX_PARTITIONS - 1)
texts = st.text(max_size=40)


# -- member ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "member_id",
    [
        "c1",
        "orders-consumer-7d9f8b6c4-x2x7k",  # a Kubernetes pod name
        "ip-10-0-3-17.eu-west-1.compute.internal",  # an EC2 host name
        "HOST-12345-ab12",
        "svc@host:9401",
        "a" * 253,
        "0",
    ],
)
def test_member_ids_that_are_accepted(member_id: str) -> None:
    assert validate_member_id(member_id) == member_id


@pytest.mark.parametrize(
    "member_id",
    [
        'evil"x',  # broke the assignment JSON of every consumer
        "CORP\\nancy",  # a backslash: its partitions were never claimed
        "two words",
        "tab\there",
        "line\nbreak",
        "nul\x00",
        "a/b",  # an id is one etcd key segment
        "",
        "-leading-dash",
        ".hidden",
        "a" * 254,
        "café",  # ASCII only
        "x'y",
        "{json}",
    ],
)
def test_member_ids_that_are_refused(member_id: str) -> None:
    with pytest.raises(InvalidMemberId, match="invalid member id") as refused:
        validate_member_id(member_id)
    message = str(refused.value)
    assert "\n" not in message  # a one-line error: the CLI prints it as it is
    assert isinstance(refused.value, UsageError)  # exit code 2


def test_the_default_member_id_is_valid() -> None:
    assert validate_member_id(default_member_id())
    assert validate_member_id(ConsumerConfig("s").member)


def test_a_consumer_config_refuses_a_bad_member_id() -> None:
    with pytest.raises(InvalidMemberId):
        ConsumerConfig("s", member_id='evil"x')


@settings(max_examples=300)
@given(st.text(alphabet=st.characters(codec=None), max_size=300))
def test_validation_is_exactly_the_documented_pattern(candidate: str) -> None:
    allowed = set(string.ascii_letters + string.digits + "_.:@-")
    expected = (
        1 <= len(candidate) <= 253
        and candidate[0] in string.ascii_letters + string.digits
        and set(candidate) <= allowed
    )
    assert expected == bool(re.fullmatch(MEMBER_ID_PATTERN, candidate))
    if expected:
        assert validate_member_id(candidate) == candidate
    else:
        with pytest.raises(InvalidMemberId):
            validate_member_id(candidate)


# -- round trips -------------------------------------------------------------------------------


@given(member_ids, st.integers(1, 1000), leases, texts, st.integers(0, 2**31), texts, times)
def test_a_member_round_trips(
    member_id: str, weight: int, lease: int, host: str, pid: int, version: str, started: float
) -> None:
    member = Member(member_id, weight, lease, host, pid, version, started)
    raw = encode_member(member).encode()
    assert kinds.decode("member", STREAM, member_id, raw, lease) == member


@given(member_ids, partitions)
def test_an_assignment_round_trips(owner: str, partition: int) -> None:
    raw = encode_assignment(owner)
    assert json.loads(raw) == {"owner": owner, "v": 1}
    assert kinds.decode("assignment", STREAM, f"{partition:05d}", raw.encode()) == Assignment(owner)


def test_the_assignment_wire_format_is_unchanged() -> None:
    # What the leader wrote before (the f-string, for an id it could format): readable as is
    assert encode_assignment("c1") == '{"owner": "c1", "v": 1}'


@given(member_ids, leases, times, partitions)
def test_a_claim_round_trips(member: str, lease: int, at: float, partition: int) -> None:
    raw = encode_claim(member, at).encode()
    assert kinds.decode("claim", STREAM, f"{partition:05d}", raw, lease) == Claim(member, lease, at)


@given(member_ids, leases, times, st.integers(0, 2**31 - 1), st.booleans())
def test_a_claim_with_its_priority_and_seal_round_trips(
    member: str, lease: int, at: float, priority: int, sealed: bool
) -> None:
    raw = encode_claim(member, at, priority=priority, sealed=sealed).encode()
    claim = Claim(member, lease, at, priority=priority, sealed=sealed)
    assert kinds.decode("claim", STREAM, "00000", raw, lease) == claim


def test_a_claim_without_priority_is_written_as_before() -> None:
    assert json.loads(encode_claim("c1", 5.0)) == {"member": "c1", "at": 5.0, "v": 1}


@given(st.integers(1, 2**64 - 1))
def test_a_leader_candidate_round_trips(lease: int) -> None:
    name = f"{lease:016x}"
    assert kinds.decode("leader", STREAM, name, codec.encode_candidate(), lease) == Candidate(lease)
    for other in (0, lease ^ 1):  # issue 43, item 5: on no lease, or not its own
        with pytest.raises(MalformedValue, match="on the lease its name gives"):
            kinds.decode("leader", STREAM, name, codec.encode_candidate(), other)


@given(
    st.one_of(
        st.builds(Rebalance, times),
        st.builds(Move, partitions, member_ids, times),
        st.builds(Drain, member_ids, times),
    )
)
def test_a_request_round_trips(request: Rebalance | Move | Drain) -> None:
    name, raw = encode_request(request)
    assert name == request.name
    assert kinds.decode("request", STREAM, name, raw.encode()) == request


@given(st.integers(1, MAX_PARTITIONS), st.sampled_from(["quorum", "classic"]))
def test_a_spec_round_trips(count: int, queue_type: Any) -> None:
    spec = StreamSpec(STREAM, count, queue_type)
    assert kinds.decode("spec", STREAM, STREAM, spec.to_json().encode()) == spec


def test_encoders_refuse_what_decoders_would() -> None:
    with pytest.raises(InvalidMemberId):
        encode_assignment('evil"x')
    with pytest.raises(InvalidMemberId):
        encode_claim("CORP\\nancy", 0.0)
    with pytest.raises(InvalidMemberId):
        encode_request(Drain("a b"))
    with pytest.raises(ValueError, match="finite"):
        encode_claim("c1", float("nan"))
    with pytest.raises(ValueError, match="weight"):
        encode_member(Member("c1", weight=0))
    with pytest.raises(ValueError, match="partition"):
        encode_request(Move(MAX_PARTITIONS, "c1"))


# -- malformed values ----------------------------------------------------------------------------

VALID = {
    "member": ("c1", encode_member(Member("c1", 1, 0, "h", 1, "0.1.0", 1.0))),
    "assignment": ("00001", encode_assignment("c1")),
    "claim": ("00001", encode_claim("c1", 1.0)),
    "leader": ("00000000000000ab", ""),
    "request": ("rebalance", encode_request(Rebalance(1.0))[1]),
    "spec": (STREAM, StreamSpec(STREAM, 4).to_json()),
}


@pytest.mark.parametrize(
    ("kind", "name", "raw", "reason"),
    [
        ("assignment", "00001", b'{"v": 1, "owner": "c1', "not JSON"),
        ("assignment", "00001", b"\xff\xfe\xfa", "not JSON"),
        ("assignment", "00001", b"[1, 2]", "not a JSON object"),
        ("assignment", "00001", b'{"v": 1}', "no 'owner'"),
        ("assignment", "00001", b'{"owner": "c1"}', 'no version "v"'),
        ("assignment", "00001", b'{"v": 2, "owner": "c1"}', "version 2"),
        ("assignment", "00001", b'{"v": true, "owner": "c1"}', "version True"),
        ("assignment", "00001", b'{"v": 1, "owner": 7}', "not a string"),
        ("assignment", "00001", b'{"v": 1, "owner": "evil\\"x"}', "not a valid member id"),
        ("assignment", "1", b'{"v": 1, "owner": "c1"}', "names no partition"),
        ("assignment", "99999", b'{"v": 1, "owner": "c1"}', "names no partition"),
        ("claim", "00001", b'{"v": 1, "member": "c1"}', "no 'at'"),
        ("claim", "00001", b'{"v": 1, "member": "c1", "at": "now"}', "not a number"),
        ("claim", "00001", b'{"v": 1, "member": "c1", "at": NaN}', "not JSON"),
        ("member", "c1", b'{"v": 1}', "no 'id'"),
        ("member", "c1", b'{"v": 1, "id": "c2", "weight": 1}', "not the key's"),
        ("member", 'evil"x', VALID["member"][1].encode(), "invalid member id"),
        ("member", "c1", VALID["member"][1].replace('"weight": 1', '"weight": 0'), "weight"),
        ("leader", "not-a-lease", b"", "named by its lease"),
        ("leader", "00000000000000ab", b"x", "empty"),
        ("request", "rebalance", b'{"v": 1}', "no 'at'"),
        ("request", "reboot", b'{"v": 1, "at": 1}', "no request is called"),
        ("request", "move-3", b'{"v": 1, "partition": 4, "to": "c1", "at": 1}', "not the key"),
        ("request", "move-x", b'{"v": 1, "partition": 4, "to": "c1", "at": 1}', "move-<"),
        ("request", "drain-c1", b'{"v": 1, "member": "c2", "at": 1}', "not the key"),
        ("request", "drain-a b", b'{"v": 1, "member": "a b", "at": 1}', "invalid member id"),
        ("spec", STREAM, b"{not json", "not JSON"),
        ("spec", STREAM, b'{"v": 1}', "no 'name'"),
        (
            "spec",
            STREAM,
            b'{"v": 1, "name": "x", "partitions": 0, "queue_type": "quorum"}',
            "between 1",
        ),
        ("spec", STREAM, StreamSpec("other", 4).to_json(), "not 'orders'"),
        ("spec", STREAM, b'{"v": 9, "name": "orders"}', "version 9"),
    ],
)
def test_malformed_values_are_refused_saying_why(
    kind: str, name: str, raw: bytes | str, reason: str
) -> None:
    with pytest.raises(MalformedValue) as refused:
        kinds.decode(kind, STREAM, name, raw)
    assert reason in str(refused.value)


@settings(max_examples=300)
@given(
    st.sampled_from(sorted(VALID)),
    st.one_of(
        st.binary(max_size=64),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.sampled_from(["v", "owner", "member", "at", "id"]), inner)
            ),
            max_leaves=8,
        ).map(lambda doc: json.dumps(doc).encode()),
    ),
)
def test_decoding_raises_nothing_but_malformed_value(kind: str, raw: bytes) -> None:
    name = VALID[kind][0]
    with contextlib.suppress(MalformedValue):  # and nothing else
        kinds.decode(kind, STREAM, name, raw)


def test_deeply_nested_json_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedValue):
        kinds.decode("assignment", STREAM, "00001", b"[" * 100_000)


def test_a_malformed_stream_spec_names_its_key() -> None:
    key = "/partq/v1/streams/orders/spec"
    with pytest.raises(MalformedValue, match=f"malformed stream spec at {key}: not JSON"):
        StreamSpec.from_json(b"{not json", key)
    with pytest.raises(MalformedValue, match="no 'partitions'"):
        StreamSpec.from_json('{"v": 1, "name": "orders"}', key)
    with pytest.raises(UsageError, match="version 3 is not understood"):  # 2: a resized spec
        StreamSpec.from_json('{"v": 3}', key)


def test_a_leaving_member_round_trips_and_an_old_value_is_not_leaving() -> None:
    member = Member("c-1", weight=2, lease=7, host="h", pid=3, version="1", started=1.0)
    raw = codec.encode_member(member)
    assert "leaving" not in json.loads(raw)  # values of members that stay are as before
    assert kinds.decode("member", "s", "c-1", raw, 7) == member
    leaving = codec.encode_member(Member("c-1", leaving=True))
    assert kinds.decode("member", "s", "c-1", leaving, 7).leaving is True
    garbled = json.dumps({**json.loads(leaving), "leaving": "yes"})
    with pytest.raises(MalformedValue, match="'leaving' is not true or false"):
        kinds.decode("member", "s", "c-1", garbled, 7)


def test_a_policy_round_trips_and_a_foreign_one_is_malformed() -> None:
    from partq.coordinator.store import codec

    from partq.kernel.errors import MalformedValue

    policy = {"balance": "load", "manual": False, "max_moves": None, "settle": 0.5, "ttl": 5}
    assert codec.decode_policy(codec.encode_policy(policy)) == policy
    for raw in ('{"v": 1, "policy": [1]}', '{"v": 1, "policy": {"x": {"nested": 1}}}', "nope"):
        with pytest.raises(MalformedValue):
            codec.decode_policy(raw)
