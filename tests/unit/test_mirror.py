"""partq.coordinator.store.mirror.GroupMirror: a snapshot plus the watch's events equals a
later snapshot."""

from __future__ import annotations

import queue
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from partq.coordinator.store import codec
from partq.coordinator.store.codec import Assignment, Candidate, Claim, Drain, Member
from partq.coordinator.store.group import Group, WatchEvent
from partq.coordinator.store.mirror import GroupMirror
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd

STREAM = "orders"
SPEC = StreamSpec(STREAM, 4)


def test_apply_mirrors_every_kind_and_names_the_partitions_it_touched() -> None:
    mirror = GroupMirror()
    assert mirror.apply(WatchEvent("member", "a", Member("a", 2))) == set()
    assert mirror.apply(WatchEvent("assignment", "00003", Assignment("a"))) == {3}
    assert mirror.apply(WatchEvent("claim", "00003", Claim("a", 7), revision=10)) == {3}
    assert (
        mirror.apply(
            WatchEvent("leader", "00000000000000aa", Candidate(0xAA), revision=4, created=4)
        )
        == set()
    )
    assert (
        mirror.apply(
            WatchEvent("leader", "00000000000000aa", Candidate(0xAA), revision=9, created=4)
        )
        == set()
    )
    mirror.apply(WatchEvent("request", "drain-a", Drain("a")))
    mirror.apply(WatchEvent("spec", STREAM, SPEC))
    assert mirror == GroupMirror(
        members={"a": Member("a", 2)},
        assignment={3: "a"},
        claims={3: Claim("a", 7)},
        claim_revisions={3: 10},
        candidates={"00000000000000aa": 4},
        requests={"drain-a": Drain("a")},
        spec=SPEC,
    )
    # Deleted or malformed (value None): absent
    for kind, name in [
        ("member", "a"),
        ("assignment", "00003"),
        ("claim", "00003"),
        ("leader", "00000000000000aa"),
        ("request", "drain-a"),
        ("spec", STREAM),
    ]:
        mirror.apply(WatchEvent(kind, name, None, revision=11, malformed="not JSON"))  # type: ignore[arg-type]
    assert mirror == GroupMirror()


def test_forged_claims_are_kept_apart_and_sorted_again_when_members_change() -> None:
    # Given: members a (lease 10) and b (lease 20)
    mirror = GroupMirror()
    mirror.apply(WatchEvent("member", "a", Member("a", lease=10)))
    mirror.apply(WatchEvent("member", "b", Member("b", lease=20)))
    # When: claims arrive on no lease, on a's lease in b's name, on b's own lease
    assert mirror.apply(WatchEvent("claim", "00000", Claim("b", 0), revision=5)) == {0}
    assert mirror.apply(WatchEvent("claim", "00001", Claim("b", 10), revision=6)) == {1}
    assert mirror.apply(WatchEvent("claim", "00002", Claim("b", 20), revision=7)) == {2}
    # Then: readers see only b's own; the forged ones are kept with their revisions
    assert mirror.claims == {2: Claim("b", 20)}
    assert mirror.forged == {0: Claim("b", 0), 1: Claim("b", 10)}
    assert mirror.claim_revisions == {0: 5, 1: 6, 2: 7}
    # When: a leaves (lease 10 holds no member key now): 1 is a leftover, honoured
    assert mirror.apply(WatchEvent("member", "a", None)) == {1}
    assert mirror.claims == {1: Claim("b", 10), 2: Claim("b", 20)}
    # ... and a joins again on lease 10: forged again
    assert mirror.apply(WatchEvent("member", "a", Member("a", lease=10))) == {1}
    assert 1 in mirror.forged
    # When: the forged claim is deleted, it is gone from both
    assert mirror.apply(WatchEvent("claim", "00000", None, revision=8)) == {0}
    assert 0 not in mirror.forged and 0 not in mirror.claim_revisions


def test_our_own_claim_writes_make_older_claim_events_stale() -> None:
    mirror = GroupMirror()
    mirror.wrote_claim(1, Claim("me", 5), revision=20)
    assert mirror.apply(WatchEvent("claim", "00001", None, revision=19)) == set()  # older
    assert mirror.apply(WatchEvent("claim", "00001", Claim("me", 5), revision=20)) == set()
    assert mirror.claims == {1: Claim("me", 5)}
    mirror.wrote_claim(1, None, revision=30)  # our release
    assert mirror.apply(WatchEvent("claim", "00001", Claim("me", 5), revision=25)) == set()
    assert mirror.claims == {}
    assert mirror.apply(WatchEvent("claim", "00001", Claim("other", 6), revision=31)) == {1}
    assert mirror.claims == {1: Claim("other", 6)}


# -- the watch keeps a mirror equal to a fresh snapshot ----------------------------------------

WRITES: dict[str, tuple[Callable[[int], str], Callable[[int], str]]] = {
    "member": (
        lambda i: keys.member(STREAM, f"m{i}"),
        lambda i: codec.encode_member(Member(f"m{i}", weight=i + 1)),
    ),
    "assignment": (
        lambda i: keys.assignment(STREAM, i),
        lambda i: codec.encode_assignment(f"m{i}"),
    ),
    "claim": (lambda i: keys.claim(STREAM, i), lambda i: codec.encode_claim(f"m{i}", 0)),
    "leader": (lambda i: keys.leader_candidate(STREAM, i + 1), lambda i: ""),
    "request": (
        lambda i: keys.request(STREAM, f"drain-m{i}"),
        lambda i: codec.encode_request(Drain(f"m{i}"))[1],
    ),
}
operations = st.tuples(
    st.sampled_from(sorted(WRITES)),
    st.integers(0, 3),
    st.sampled_from(["put", "delete", "garbage"]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(operations, max_size=6), st.lists(operations, max_size=12))
def test_snapshot_plus_watch_equals_a_later_snapshot(
    before: list[tuple[str, int, str]], after: list[tuple[str, int, str]]
) -> None:
    fake = FakeEtcd()
    fake.put(keys.spec(STREAM), SPEC.to_json())
    group = Group(fake, "fake", STREAM, report=False)

    def write(kind: str, i: int, how: str) -> None:
        key, value = WRITES[kind][0](i), WRITES[kind][1](i)
        if how == "delete":
            fake.delete(key)
        else:
            fake.put(key, value if how == "put" else "{not json")

    for op in before:
        write(*op)
    state = group.snapshot()
    mirror = GroupMirror.of(state)
    events: queue.Queue[WatchEvent | Exception] = queue.Queue()
    group.watch(state.revision, events.put)
    for op in after:
        write(*op)
    while not events.empty():
        event = events.get()
        assert isinstance(event, WatchEvent)
        mirror.apply(event)
    fresh = GroupMirror.of(group.snapshot())
    assert mirror == fresh
