"""partq.coordinator.leader.policy: the leader's rules as pure functions (and the dry run that
shares them)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from partq.coordinator.leader import policy
from partq.coordinator.store.codec import Claim, Drain, Member, Move, Parked, Rebalance, Request
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec, key_id, partition_for
from partq.producer.registry import Registry

from partq.cli.context import Context
from partq.cli.operate import rebalance
from tests.fakes.etcd import FakeEtcd

SPEC = StreamSpec("orders", 8)


@dataclass
class View:
    members: dict[str, Member] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    claims: dict[int, Claim] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    standbys: dict[int, str] = field(default_factory=dict)


def view(
    members: dict[str, int],
    assignment: dict[int, str] | None = None,
    claimed: dict[int, str] | None = None,
    drain: tuple[str, ...] = (),
) -> View:
    return View(
        {m: Member(m, w) for m, w in members.items()},
        dict(assignment or {}),
        {p: Claim(m, lease=1) for p, m in (claimed or {}).items()},
        {f"drain-{m}": Drain(m) for m in drain},
    )


def counts(assignment: dict[int, str]) -> dict[str, int]:
    return dict(Counter(assignment.values()))


# -- draining, in motion ---------------------------------------------------------------------


def test_draining_is_the_members_named_by_drain_requests() -> None:
    requests: dict[str, Request] = {
        "drain-a": Drain("a"),
        "move-1": Move(1, "b"),
        "rebalance": Rebalance(),
        "drain-c": Drain("c"),
    }
    assert policy.draining(requests) == {"a", "c"}
    assert policy.draining({}) == set()


def test_in_motion_is_assigned_but_not_claimed_by_the_owner() -> None:
    claims = {0: Claim("a", 1), 1: Claim("a", 1), 3: Claim("b", 2)}
    assert policy.in_motion({0: "a", 1: "b", 2: "b", 3: "b"}, claims) == {1, 2}


# -- plan ------------------------------------------------------------------------------------


def test_plan_without_members_is_empty_and_with_members_covers_the_stream() -> None:
    assert policy.plan(SPEC, view({}), None) == {}
    assert counts(policy.plan(SPEC, view({"a": 1, "b": 1}), None)) == {"a": 4, "b": 4}
    # partitions outside the stream and owners that left are not kept
    step = policy.plan(SPEC, view({"a": 1}, {9: "a", 0: "gone"}), None)
    assert step == dict.fromkeys(range(8), "a")


def test_plan_leaves_draining_members_out() -> None:
    v = view({"a": 1, "b": 1}, dict.fromkeys(range(8), "a"), drain=("a",))
    assert policy.plan(SPEC, v, None) == dict.fromkeys(range(8), "b")
    # and with every member draining there is nothing to plan
    assert policy.plan(SPEC, view({"a": 1}, drain=("a",)), None) == {}


def test_max_moves_counts_the_partitions_already_in_motion() -> None:
    # a owns all 8 and consumes 6 of them; 2 are already moving to b (claimed by a still)
    assignment = {**dict.fromkeys(range(6), "a"), 6: "b", 7: "b"}
    v = view({"a": 1, "b": 1}, assignment, claimed=dict.fromkeys(range(8), "a"))
    assert policy.plan(SPEC, v, max_moves=2) == assignment  # the budget is used up
    step = policy.plan(SPEC, v, max_moves=3)
    assert counts(step) == {"a": 5, "b": 3}
    # unclaimed partitions (no owner consuming them) are not "in motion" from anyone
    fresh = view({"a": 1, "b": 1})
    assert counts(policy.plan(SPEC, fresh, max_moves=1)) == {"a": 4, "b": 4}


@st.composite
def views(draw: st.DrawFn) -> View:
    ids = draw(st.lists(st.sampled_from("abcdef"), min_size=0, max_size=6, unique=True))
    members = {m: draw(st.integers(1, 3)) for m in ids}
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    owners = [*ids, "gone"]
    assignment = {p: rng.choice(owners) for p in range(10) if rng.random() < 0.7}
    claimed = {p: rng.choice(owners) for p in range(10) if rng.random() < 0.5}
    drain = tuple(m for m in ids if rng.random() < 0.2)
    return view(members, assignment, claimed, drain)


@given(views(), st.one_of(st.none(), st.integers(0, 5)))
def test_plan_properties(v: View, max_moves: int | None) -> None:
    step = policy.plan(SPEC, v, max_moves)
    live = set(v.members) - policy.draining(v.requests)
    if not live:
        assert step == {}
        return
    # every partition of the stream gets a live, non-draining owner
    assert sorted(step) == list(range(SPEC.partitions))
    assert set(step.values()) <= live
    # moves away from a live owner, plus those already under way, stay within the budget
    current = {p: o for p, o in v.assignment.items() if o in live and p < SPEC.partitions}
    moved = {p for p, o in current.items() if step[p] != o}
    if max_moves is not None:
        moving = {p for p in policy.in_motion(current, v.claims) if p in v.claims}
        assert len(moved) <= max(0, max_moves - len(moving))
    else:  # without a limit the plan is balanced at once
        total = sum(v.members[m].weight for m in live)
        for m in live:
            share = SPEC.partitions * v.members[m].weight / total
            assert abs(counts(step).get(m, 0) - share) < 1


# -- settle, min members, reasons ----------------------------------------------------------------


def test_settled_once_the_timer_ran_out_or_when_none_runs() -> None:
    assert policy.settled(None, 5.0)
    assert not policy.settled(5.1, 5.0)
    assert policy.settled(5.0, 5.0)


def test_the_first_assignment_waits_for_min_members_that_are_not_draining() -> None:
    rules = {"min_members": 2, "max_moves": None, "first": True, "after_claim": False}
    assert policy.automatic(SPEC, view({"a": 1}), **rules) is None
    assert policy.automatic(SPEC, view({"a": 1, "b": 1}, drain=("b",)), **rules) is None
    step = policy.automatic(SPEC, view({"a": 1, "b": 1}), **rules)
    assert step is not None and step.reason == "startup" and step.planned
    assert counts(dict(step.target or {})) == {"a": 4, "b": 4}
    # once something is assigned, min members no longer holds anything back
    later = {**rules, "first": False}
    step = policy.automatic(SPEC, view({"a": 1}, {0: "x"}), **later)
    assert step is not None and step.reason == "membership"
    step = policy.automatic(SPEC, view({"a": 1}, {0: "x"}), **{**later, "after_claim": True})
    assert step is not None and step.reason == "step"


# -- operator requests ---------------------------------------------------------------------------


def test_rebalance_plans_one_step_and_is_cleared() -> None:
    v = view({"a": 1, "b": 1}, dict.fromkeys(range(8), "a"), claimed=dict.fromkeys(range(8), "a"))
    step = policy.requested(Rebalance(), SPEC, v, max_moves=1)
    assert (step.reason, step.planned, step.clear) == ("manual", True, True)
    assert counts(dict(step.target or {})) == {"a": 7, "b": 1}


def test_move_gives_a_partition_to_a_live_member_else_is_ignored() -> None:
    v = view({"a": 1, "b": 1}, dict.fromkeys(range(8), "a"))
    step = policy.requested(Move(3, "b"), SPEC, v, None)
    assert step.target == {**dict.fromkeys(range(8), "a"), 3: "b"}
    assert (step.reason, step.planned, step.clear, step.ignored) == ("move", False, True, None)
    for bad in (Move(3, "nobody"), Move(8, "b")):
        step = policy.requested(bad, SPEC, v, None)
        assert step.target is None and step.clear and step.ignored


def test_drain_plans_while_the_member_owns_partitions_and_ends_when_it_left() -> None:
    owning = view({"a": 1, "b": 1}, {0: "a", 1: "b"}, drain=("a",))
    step = policy.requested(Drain("a"), SPEC, owning, None)
    assert (step.reason, step.planned, step.clear) == ("drain", True, False)
    assert step.target == dict.fromkeys(range(8), "b")
    owning_nothing = view({"a": 1, "b": 1}, dict.fromkeys(range(8), "b"), drain=("a",))
    assert policy.requested(Drain("a"), SPEC, owning_nothing, None) == policy.Step("drain")
    gone = view({"b": 1}, drain=("a",))
    assert policy.requested(Drain("a"), SPEC, gone, None) == policy.Step("drain", clear=True)


# -- metrics helpers -----------------------------------------------------------------------------


def test_owned_and_imbalance() -> None:
    v = view({"a": 1, "b": 3}, {0: "a", 1: "a", 2: "gone", 9: "b", 3: "b"})
    owned = policy.owned(SPEC, v)
    assert owned == {0: "a", 1: "a", 3: "b"}
    # a holds 2 of a share of 2, b holds 1 of a share of 6
    assert policy.imbalance(SPEC, v.members, owned) == pytest.approx(5.0)
    assert policy.imbalance(SPEC, {}, {}) == 0.0


# -- the dry run prints the plan the leader would write -----------------------------------------


def test_rebalance_dry_run_prints_the_leaders_plan() -> None:
    # Given a stream whose member a owns everything while an operator drains it
    fake = FakeEtcd()
    registry = Registry(fake, "fake")
    registry.create(StreamSpec("orders", 4))
    group = Group(fake, "fake", "orders", report=False)
    sessions = [Session(fake, "fake", ttl=5) for _ in range(2)]
    try:
        group.join(sessions[0], "a")
        group.join(sessions[1], "b")
        for p in range(4):
            fake.put(f"/partq/v1/streams/orders/assignment/{p:05d}", '{"owner": "a", "v": 1}')
        group.request(Drain("a"))
        # When the operator asks for a dry run
        context = Context(config=None, overrides={}, _registry=registry)
        result = CliRunner().invoke(rebalance, ["orders", "--dry-run"], obj=context)
        # Then it prints the plan's moves (a is left out), and writes nothing
        assert result.exit_code == 0, result.output
        state = group.snapshot()
        expected = policy.plan(state.spec or SPEC, state, None)
        assert expected == dict.fromkeys(range(4), "b")
        assert result.output.splitlines() == [
            *(f"partition {p}: a -> b" for p in range(4)),
            "4 partitions would change owner",
        ]
        assert "rebalance" not in state.requests
    finally:
        for session in sessions:
            session.close()


def test_claims_not_on_their_members_lease_are_forged_or_a_restarted_members() -> None:
    members = {"a": Member("a", lease=10), "b": Member("b", lease=20)}
    claims = {
        0: Claim("a", 10, 1.0),  # on a's lease: bound
        1: Claim("b", 10, 1.0),  # b's name on a's lease: forged
        2: Claim("c", 30, 1.0),  # a lease no member holds: a departed member's, draining
        3: Claim("b", 20, 1.0),
        4: Claim("b", 0, 1.0),  # on no lease: forged (it would never go)
        5: Claim("c", 0, 1.0),  # ... whoever it names
        6: Claim("c", 20, 1.0),  # a non-member's name on b's lease: forged
        7: Claim("b", 30, 1.0),  # b's name on a lease no member holds: b restarted
    }
    forged = policy.forged_claims(members, claims)
    assert sorted(forged) == [1, 4, 5, 6]
    honoured = {p: c for p, c in claims.items() if p not in forged}
    assert sorted(policy.unbound_claims(members, honoured)) == [2, 7]


def test_a_parked_record_counts_only_if_its_partitions_holder_wrote_it() -> None:
    p = partition_for("k", SPEC.partitions)
    a, b = Member("a", lease=10), Member("b", lease=20)
    record = Parked(key_id("k"), p, "e", "E", "m", "a", 1.0)
    assert policy.parked_by_holder(record, SPEC.partitions, Claim("a", 10), a)
    # the claim then was b's, or a's on another lease, or there was none
    assert not policy.parked_by_holder(record, SPEC.partitions, Claim("b", 20), a)
    assert not policy.parked_by_holder(record, SPEC.partitions, Claim("a", 20), a)
    assert not policy.parked_by_holder(record, SPEC.partitions, None, a)
    assert not policy.parked_by_holder(record, SPEC.partitions, Claim("a", 10), None)
    assert not policy.parked_by_holder(record, SPEC.partitions, Claim("b", 20), b)
    assert not policy.parked_by_holder(  # a lease-less member and claim
        record, SPEC.partitions, Claim("a", 0), Member("a", lease=0)
    )
    # a key of another partition, recorded under a partition a holds
    other = Parked(key_id("k"), (p + 1) % SPEC.partitions, "e", "E", "m", "a", 1.0)
    assert not policy.parked_by_holder(other, SPEC.partitions, Claim("a", 10), a)


def test_a_member_that_announced_its_stop_gets_no_partitions() -> None:
    view = View(
        members={"a": Member("a", lease=1), "b": Member("b", lease=2, leaving=True)},
        assignment={p: "b" if p % 2 else "a" for p in range(SPEC.partitions)},
    )
    assert set(policy.plan(SPEC, view, None).values()) == {"a"}
    assert policy.leaving(view.members) == {"b"}


def test_differences_name_each_setting_coordinators_disagree_on() -> None:
    from partq.coordinator.leader.policy import differences

    # Given three coordinators, two alike, one balancing by load and manual
    alike = {"balance": "count", "manual": False, "settle": 1.0}
    found = {"a": alike, "b": dict(alike), "c": {**alike, "balance": "load", "manual": True}}
    # Then each differing setting is named with how many run each value; none when alike
    assert differences(found) == ['balance: "count" (2), "load" (1)', "manual: false (2), true (1)"]
    assert differences({"a": alike, "b": dict(alike)}) == []
    assert differences({}) == []
