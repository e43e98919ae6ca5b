"""partq.coordinator.store.group.Group as the store of the group keys, on a FakeEtcd: the table of
key
kinds it reads through, the leader's fenced writes, and reads of the past."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from partq.coordinator.store import codec, kinds
from partq.coordinator.store.election import Election
from partq.coordinator.store.group import Group, Parked
from partq.coordinator.store.mirror import GroupKeys
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from partq.kernel.errors import EtcdCompacted
from tests.fakes.etcd import FakeEtcd

STREAM = "orders"
NAMES = {  # a name partq gives a key of each kind
    "member": "c1",
    "assignment": "00003",
    "claim": "00003",
    "standby": "00003",
    "leader": "00000000000000ab",
    "request": "move-3",
    "parked": "a2V5",
    "drained": "2/00011",
    "spec": STREAM,
    "resize": STREAM,
}


@pytest.fixture
def fake() -> FakeEtcd:
    return FakeEtcd()


@pytest.fixture
def session(fake: FakeEtcd) -> Iterator[Session]:
    made = Session(fake, "fake", ttl=5)
    yield made
    made.close()


def test_every_kind_has_one_row_and_its_keys_are_read_back_as_that_kind() -> None:
    fields = {f.name for f in dataclasses.fields(GroupKeys)}
    assert set(kinds.KINDS) == set(NAMES)
    for kind, row in kinds.KINDS.items():
        key = row.key(STREAM, NAMES[kind])
        assert key.startswith(keys.stream_prefix(STREAM))
        found = kinds.kind_of(STREAM, key)
        assert found is not None and found[0] is row and found[1] == NAMES[kind]
        assert row.mirror in fields and (row.revisions is None or row.revisions in fields)
    assert kinds.kind_of(STREAM, keys.stream_prefix(STREAM) + "elsewhere/x") is None


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("rebalance", (codec.Rebalance, None)),
        ("pause", (codec.Pause, None)),
        ("pause-12", (codec.Pause, 12)),
        ("move-0", (codec.Move, 0)),
        ("drain-c-1", (codec.Drain, "c-1")),
    ],
)
def test_a_request_name_is_parsed_once_and_written_back_the_same(name: str, parsed: Any) -> None:
    assert codec.parse_request_name(name) == parsed
    request = {
        codec.Rebalance: lambda _: codec.Rebalance(),
        codec.Pause: codec.Pause,
        codec.Move: lambda p: codec.Move(p, "c1"),
        codec.Drain: codec.Drain,
    }[parsed[0]](parsed[1])
    assert request.name == name


def test_the_leaders_writes_go_in_fenced_chunks_and_stop_at_another_leader(
    fake: FakeEtcd, session: Session
) -> None:
    group = Group(fake, "fake", STREAM)
    election = Election(group)
    fence = election.campaign(session)
    calls: list[int] = []
    transaction = fake.transaction

    def counting(compare: list[Any], success: Any = None, failure: Any = None) -> Any:
        calls.append(len(success or []))
        return transaction(compare, success, failure)

    fake.transaction = counting  # type: ignore[method-assign]
    # When the leader writes 250 owners / Then in three transactions, every one written
    assert group.assign(fence, {p: "c1" for p in range(250)}) == list(range(250))
    assert calls == [100, 100, 50]
    assert group.snapshot().assignment == {p: "c1" for p in range(250)}
    # And standbys are put and deleted alike
    assert group.name_standbys(fence, [(1, "c2"), (2, "c2")]) == [1, 2]
    assert group.name_standbys(fence, [(1, None)]) == [1]
    assert group.snapshot().standbys == {2: "c2"}
    # When its candidate key is gone (deposed) / Then nothing more is written
    election.resign()
    assert fake.get(fence.key) == (None, None)
    assert group.assign(fence, {0: "c2"}) == []
    assert group.snapshot().assignment[0] == "c1"


def test_a_parked_records_judges_are_read_as_they_were_until_compacted(
    fake: FakeEtcd, session: Session
) -> None:
    # Given a stream of 4 partitions and a member holding partition 3 that parks a key,
    # then leaves, and then the stream is resized to 7
    fake.put(keys.spec(STREAM), StreamSpec(STREAM, 4).to_json())
    group = Group(fake, "fake", STREAM)
    group.join(session, "c1")
    assert group.claim(3, "c1", session)
    record = Parked("a2V5", 3, "boom", "ValueError", "m-1", "c1", 1.0)
    revision = group.park(record, session)
    group.release(3, session)
    group.leave("c1", session)
    fake.put(keys.spec(STREAM), StreamSpec(STREAM, 7, epoch=1).to_json())
    # Then the claim, the member and the spec are read as they were when it parked
    claim, member, spec = group.parked_at(record, revision)
    assert claim is not None and claim.member == "c1" and claim.lease == session.id
    assert member is not None and member.id == "c1"
    assert spec is not None and (spec.partitions, spec.epoch) == (4, 0)
    # When etcd compacts that revision away / Then it says so, as such, to a read
    fake.compact(fake.get_prefix_response("/").header.revision)
    with pytest.raises(EtcdCompacted):
        group.parked_at(record, revision)
    # ... and to a watch from before it (its owner reads afresh, not as if etcd were down)
    ended: list[object] = []
    group.watch(revision, ended.append)
    assert len(ended) == 1 and isinstance(ended[0], EtcdCompacted)
