"""Hot standby rules (pure): who stands by, when a standby may take over, what follows."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from partq.consumers.state.handoff import State
from partq.consumers.state.standby import may_take_over, wanted
from partq.coordinator.leader import policy
from partq.coordinator.leader.assignor import assign
from partq.coordinator.store import codec, kinds
from partq.coordinator.store.codec import Claim, Member, Pause, Standby
from partq.coordinator.store.group import Group, GroupState
from partq.coordinator.store.mirror import GroupMirror
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from tests.fakes.etcd import FakeEtcd

SPEC = StreamSpec("s", 4)
A, B, C = Member("a", lease=1), Member("b", lease=2), Member("c", lease=3)


def state(**changes: object) -> GroupState:
    """p0 owned by a (claimed), b its standby; b and c members too."""
    base = GroupState(
        revision=10,
        members={"a": A, "b": B, "c": C},
        assignment={0: "a", 1: "b"},
        claims={0: Claim("a", 1, live=True), 1: Claim("b", 2, live=True)},
        standbys={0: "b", 1: "c"},
        claim_revisions={0: 7, 1: 8},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_standby_of_a_live_owners_partition_may_take_it_over() -> None:
    assert may_take_over(state(), 0, "b", "a") == 7


def test_a_planned_move_or_stop_is_given_back() -> None:
    moved = state(assignment={0: "c", 1: "b"})
    assert may_take_over(moved, 0, "b", "a") is None  # the leader moved it: the owner drains
    leaving = state(members={"a": Member("a", lease=1, leaving=True), "b": B, "c": C})
    assert may_take_over(leaving, 0, "b", "a") is None  # the owner announced its stop
    left = state(members={"b": B, "c": C})
    assert may_take_over(left, 0, "b", "a") is None  # the owner left (and drains)
    released = state(claims={1: Claim("b", 2)})
    assert may_take_over(released, 0, "b", "a") is None  # the owner released its claim
    paused = state(requests={"pause": Pause()})
    assert may_take_over(paused, 0, "b", "a") is None  # an operator paused it
    assert may_take_over(state(), 0, "c", "a") is None  # not our standby
    stale = state(claims={0: Claim("a", 99, live=True), 1: Claim("b", 2)})
    assert may_take_over(stale, 0, "b", "a") is None  # not on the owner's lease


def test_a_standby_stands_behind_a_live_claim_only() -> None:
    # Given p0 just handed to a, whose consumer is not subscribed yet (its claim not live):
    # the last owner's consumer may still be there, to be cancelled
    fresh = state(claims={0: Claim("a", 1), 1: Claim("b", 2)})
    idle = State()
    # Then b does not stand by yet, and an activation (that last owner's cancel) is no
    # reason to take a's partition over
    assert not wanted(GroupMirror.of(fresh), 0, "b", idle)
    assert may_take_over(fresh, 0, "b", "a") is None
    # Once a says its consumer is subscribed (live), b stands behind it
    assert wanted(GroupMirror.of(state()), 0, "b", idle)


def test_a_partition_the_leader_gave_us_from_a_suspect_owner_may_be_taken_over() -> None:
    # a lost partition 1 to c already (a takeover claim names it), and p0 is now ours
    claims = {0: Claim("a", 1, live=True), 1: Claim("c", 3, takeover=True, taken_from="a")}
    reassigned = state(assignment={0: "b", 1: "c"}, claims=claims)
    assert may_take_over(reassigned, 0, "b", "a") == 7
    not_suspect = state(assignment={0: "b", 1: "b"})
    assert may_take_over(not_suspect, 0, "b", "a") is None  # a planned move to us: give back


def test_a_claim_that_moved_on_from_the_owner_we_stood_behind_is_given_back() -> None:
    # we stood behind c; c handed p0 to a, and we are a's standby again: c's cancel (or
    # its end) activated us, but a, live, consumes p0 (or is about to)
    assert may_take_over(state(), 0, "b", "c") is None


def test_by_default_standbys_are_named_for_every_member_on_quorum_queues_only() -> None:
    # Given a, b and d handing over by consumer priority (RabbitMQ 4 quorum queues) and c
    # not (a member on 3.x, or with --handoff drain)
    by_priority = {m: Member(m, lease=i + 1, priority=m != "c") for i, m in enumerate("abcd")}
    view = state(
        members=by_priority,
        assignment={0: "a", 1: "b", 2: "c", 3: "d"},
        claims={p: Claim(m, i + 1) for p, (i, m) in enumerate(enumerate("abcd"))},
    )
    # Then "auto" names them for every member, as "on" does, however each hands over
    everyone = {0: "b", 1: "c", 2: "d", 3: "a"}
    assert policy.standbys(SPEC, view, "auto") == everyone
    assert policy.standbys(SPEC, view, "on") == everyone
    assert policy.standbys(SPEC, view, "off") == {}
    # and a group on RabbitMQ 3.x (nobody by priority) gets them by default too
    assert policy.standbys(SPEC, state(), "auto") == {0: "b", 1: "c"}
    # but on classic queues (never soaked with standbys) only "on" names any
    classic = StreamSpec("s", 4, "classic")
    assert policy.standbys(classic, view, "auto") == {}
    assert policy.standbys(classic, view, "on") == everyone


def test_standbys_are_the_next_live_member_after_the_owner_and_suspects_get_nothing() -> None:
    view = state(
        assignment={0: "a", 1: "b", 2: "c"},
        claims={0: Claim("a", 1), 1: Claim("b", 2), 2: Claim("c", 3)},
    )
    assert policy.standbys(SPEC, view) == {0: "b", 1: "c", 2: "a"}
    unclaimed = state(assignment={0: "a", 3: "c"})
    assert 3 not in policy.standbys(SPEC, unclaimed)  # in motion: no standby yet
    alone = state(members={"a": A})
    assert policy.standbys(SPEC, alone) == {}
    took = {0: Claim("b", 2, takeover=True, taken_from="a"), 1: Claim("b", 2)}
    view = state(assignment={0: "a", 1: "b", 2: "a", 3: "c"}, claims=took)
    assert policy.takeovers(view) == {0: "b"}
    assert policy.suspects(view.claims) == {"a"}
    assert "a" not in set(policy.plan(SPEC, view, None).values())


def test_a_suspects_partition_is_planned_to_the_standby_waiting_behind_it() -> None:
    # Given a's connection died: b took p1 over already; p0 is still a's, c its standby,
    # and b has the fewest partitions (a plan by count alone would give p0 to b)
    took = {0: Claim("a", 1, live=True), 1: Claim("b", 2, takeover=True, taken_from="a")}
    view = state(
        assignment={0: "a", 1: "b", 2: "c", 3: "c"}, claims=took, standbys={0: "c", 1: "c"}
    )
    assert assign(SPEC.partitions, {"b": 1, "c": 1}, {1: "b", 2: "c", 3: "c"})[0] == "b"
    # When the leader plans, Then p0 goes to c: RabbitMQ activates c's subscription as it
    # notices a's death, and c may take over (given to anyone else, c would give back
    # what it was sent, out of order if a delivery is in flight)
    target = policy.plan(SPEC, view, None)
    assert target[0] == "c"
    assert may_take_over(dataclasses.replace(view, assignment=target), 0, "c", "a") == 7
    # and a standby that is not live, or a live owner's partition, is planned as before
    assert policy.standing_heirs(state(claims=took, standbys={0: "x"}), {"b", "c"}) == {}
    assert policy.standing_heirs(state(standbys={0: "c"}), {"b", "c"}) == {}


def test_the_assignment_follows_a_takeover_once_then_the_plan_stands() -> None:
    # Given b's takeover claim on p0 from a (dead): the assignment follows it
    took = {0: Claim("b", 2, takeover=True, taken_from="a")}
    assert policy.takeovers(state(assignment={0: "a"}, claims=took)) == {0: "b"}
    assert policy.takeovers(state(assignment={}, claims=took)) == {0: "b"}
    assert policy.takeovers(state(members={"b": B, "c": C}, assignment={0: "x"}, claims=took)) == {
        0: "b"
    }
    # When the leader then plans p0 to c (the claim still a takeover until a TTL passes)
    # Then the takeover rule does not move it back to b: no flapping between the two
    assert policy.takeovers(state(assignment={0: "c"}, claims=took)) == {}


def test_takeover_claims_and_standby_values_round_trip() -> None:
    raw = codec.encode_claim("b", 1.5, taken_from="a")
    assert kinds.decode("claim", "s", "00000", raw, 2) == Claim("b", 2, 1.5, True, "a")
    assert kinds.decode("claim", "s", "00000", codec.encode_claim("b", 1.5), 2).takeover is False
    assert kinds.decode("standby", "s", "00003", codec.encode_standby("c")) == Standby("c")


def test_read_claim_gives_the_claim_and_its_revision_for_a_takeover_transaction() -> None:
    fake = FakeEtcd()
    group = Group(fake, "fake", "s")
    mine, other = Session(fake, "fake", ttl=5), Session(fake, "fake", ttl=5)
    try:
        assert group.read_claim(0) == (None, 0)
        revision = group.claim(0, "a", other)
        claim, seen = group.read_claim(0)
        assert claim is not None and claim.member == "a" and seen == revision
        # a takeover on the revision read succeeds once; on a stale one it does not
        assert group.take_over(0, "b", mine, seen, "a") > 0
        assert group.take_over(0, "b", mine, seen, "a") == 0
        taken, _ = group.read_claim(0)
        assert taken is not None and taken.takeover and taken.taken_from == "a"
    finally:
        mine.close(revoke=True)
        other.close(revoke=True)


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(min_value=2, max_value=6),
    partitions=st.integers(min_value=2, max_value=36),
    data=st.data(),
)
def test_a_graceful_leave_with_standbys_moves_only_the_leavers_partitions(
    count: int, partitions: int, data: st.DataObject
) -> None:
    # Given a balanced group with a standby per partition
    spec = StreamSpec("s", partitions)
    members = {f"m{i}": Member(f"m{i}", lease=i + 1) for i in range(count)}
    leases = {m.id: m.lease for m in members.values()}
    assignment = assign(partitions, dict.fromkeys(members, 1), {})
    claims = {p: Claim(o, leases[o]) for p, o in assignment.items()}
    revisions = dict.fromkeys(range(partitions), 5)
    view = GroupState(1, members, assignment, claims, claim_revisions=revisions)
    behind = {p: (s, assignment[p]) for p, s in policy.standbys(spec, view).items()}
    # When one member announces its stop and the leader plans
    leaver = data.draw(st.sampled_from(sorted(members)))
    members = {**members, leaver: dataclasses.replace(members[leaver], leaving=True)}
    planned = policy.plan(spec, dataclasses.replace(view, members=members), None)
    theirs = {p for p, o in assignment.items() if o == leaver}
    assert {p for p in planned if planned[p] != assignment[p]} == theirs
    # and each of its partitions passes to its next owner, whose claim the leader gives a
    # standby, and the leaver's cancel then activates the old standby (not stood down yet)
    for p in sorted(theirs):
        claims = {**claims, p: Claim(planned[p], leases[planned[p]])}
        now = GroupState(1, members, planned, claims, claim_revisions=revisions)
        standbys = policy.standbys(spec, now)
        now = dataclasses.replace(now, standbys=standbys)
        standby, stood_behind = behind[p]
        # Then that standby gives back: no partition is taken from a live member
        assert may_take_over(now, p, standby, stood_behind) is None
    # and once the leaver is gone, the plan moves nothing more
    stayers = {m: v for m, v in members.items() if m != leaver}
    after = GroupState(1, stayers, planned, claims)
    assert policy.plan(spec, after, None) == planned
