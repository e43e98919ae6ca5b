"""partq.coordinator.store.election on a FakeEtcd: candidates, the lowest create revision
leads, the fence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from partq.coordinator.store.election import Election, Fence, leader
from partq.coordinator.store.group import Group
from partq.coordinator.store.mirror import GroupMirror
from partq.coordinator.store.session import Session

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd

STREAM = "orders"


@pytest.fixture
def fake() -> FakeEtcd:
    return FakeEtcd()


@pytest.fixture
def sessions(fake: FakeEtcd) -> Iterator[list[Session]]:
    made = [Session(fake, "fake", ttl=5) for _ in range(3)]
    yield made
    for session in made:
        session.close()


def candidates(fake: FakeEtcd) -> dict[str, int]:
    return GroupMirror.of(Group(fake, "fake", STREAM).snapshot()).candidates


def test_leader_is_the_lowest_create_revision() -> None:
    assert leader({}) is None
    assert leader({"b": 7, "a": 9, "c": 8}) == "b"


def test_the_first_candidate_leads_and_the_next_one_when_it_goes(
    fake: FakeEtcd, sessions: list[Session]
) -> None:
    # Given two candidates
    first, second = Election(Group(fake, "fake", STREAM)), Election(Group(fake, "fake", STREAM))
    fence = first.campaign(sessions[0])
    second.campaign(sessions[1])
    # Then the key is the session's, on its lease, and the earlier one leads
    assert fence.key == keys.leader_candidate(STREAM, sessions[0].id)
    assert fake.lease_of(fence.key) == sessions[0].id
    assert fence.revision == fake.get(fence.key)[1].create_revision
    assert first.is_leader(candidates(fake)) and not second.is_leader(candidates(fake))
    # When the leader's lease expires / Then the second leads
    fake.expire(sessions[0].id)
    assert second.is_leader(candidates(fake)) and not first.is_leader(candidates(fake))


def test_campaigning_again_keeps_the_candidate_key(fake: FakeEtcd, sessions: list[Session]) -> None:
    election = Election(Group(fake, "fake", STREAM))
    fence = election.campaign(sessions[0])
    fake.put(keys.stream_prefix(STREAM) + "spec", "moves the revision on")
    assert election.campaign(sessions[0]) == fence


def test_the_fence_holds_only_for_the_key_we_put(fake: FakeEtcd, sessions: list[Session]) -> None:
    election = Election(Group(fake, "fake", STREAM))
    fence = election.campaign(sessions[0])
    t = fake.transactions

    def fenced_write() -> bool:
        ok, _ = fake.transaction(compare=[fence.compare(t)], success=[t.put("/x", "1")], failure=[])
        return bool(ok)

    assert fenced_write()
    # A key put again under the same name (after ours went) is not ours
    fake.delete(fence.key)
    fake.put(fence.key, "")
    assert not fenced_write()
    assert Fence(fence.key, fake.get(fence.key)[1].create_revision).name == f"{sessions[0].id:016x}"


def test_resign_deletes_our_key_only(fake: FakeEtcd, sessions: list[Session]) -> None:
    first, second = Election(Group(fake, "fake", STREAM)), Election(Group(fake, "fake", STREAM))
    first.campaign(sessions[0])
    second.campaign(sessions[1])
    first.resign()
    assert second.is_leader(candidates(fake))
    assert not first.is_leader(candidates(fake)) and first.fence is None
    first.resign()  # nothing to resign: nothing happens
    # A resign after our key was replaced leaves the new one alone
    fence = second.fence
    assert fence is not None
    fake.delete(fence.key)
    fake.put(fence.key, "", lease=sessions[1].lease)
    second.resign()
    assert fence.name in candidates(fake)
