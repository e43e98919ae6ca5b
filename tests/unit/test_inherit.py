"""A planned handoff by consumer priority through Partitions, with no servers: a FakeEtcd
and a recording broker (RabbitMQ's side, the switch itself, is proven by
tests/integration/test_priority_handoff.py). Owner ``a`` and heir ``b`` both hand over by
priority; each test drives one side as the daemon would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from partq.consumers.control.events import StopYielding
from partq.consumers.control.partitions import Partitions
from partq.consumers.state.handoff import Event, Holder, Phase, Standby
from partq.coordinator.store import codec
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd
from tests.members import bare_partitions

SPEC = StreamSpec("s", 1)


class RecordingBroker:
    """Every call Partitions makes, with its arguments; each succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: object, **flags: bool) -> bool:
            self.calls.append((name, *args, *(flag for flag, on in flags.items() if on)))
            return True

        return record

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] == name]


class Env:
    """Members ``a``, ``b`` (by priority) and ``c`` (by drain); p0 assigned to ``a``."""

    def __init__(self) -> None:
        self.fake = FakeEtcd()
        self.group = Group(self.fake, "fake", SPEC.name)
        self.sessions = {m: Session(self.fake, "fake", ttl=5) for m in "abc"}
        for member, session in self.sessions.items():
            self.group.join(session, member, priority=member != "c")
        self.assign("a")
        self.made: list[Partitions] = []

    def side(self, member: str) -> tuple[Partitions, RecordingBroker]:
        broker = RecordingBroker()
        partitions = bare_partitions(SPEC, member, self.group, broker)
        partitions.priority = True
        partitions.session = self.sessions[member]
        self.made.append(partitions)
        return partitions, broker

    def assign(self, member: str) -> None:
        self.fake.put(keys.assignment(SPEC.name, 0), codec.encode_assignment(member))

    def heir(self) -> tuple[Partitions, RecordingBroker]:
        """``b``, assigned p0 while ``a`` holds its claim."""
        self.group.claim(0, "a", self.sessions["a"])
        self.assign("b")
        b, broker = self.side("b")
        b.follow(self.group.snapshot())
        return b, broker

    def yielded(self) -> tuple[Partitions, RecordingBroker]:
        """``a`` consuming p0, just moved to ``b``."""
        a, broker = self.owner()
        self.assign("b")
        a.follow(self.group.snapshot())
        return a, broker

    def owner(self) -> tuple[Partitions, RecordingBroker]:
        """``a`` consuming p0 on its claim."""
        a, broker = self.side("a")
        a.follow(self.group.snapshot())
        a.handoff(0, Event.SUBSCRIBED)
        assert a.slots[0].state.phase is Phase.ACTIVE
        assert broker.named("subscribe") == [("subscribe", 0, 1, 0)]  # x-priority 0
        return a, broker

    def close(self) -> None:
        for partitions in self.made:
            partitions.stop_workers()
            partitions.close()
        for session in self.sessions.values():
            session.close(revoke=True)


@pytest.fixture
def env() -> Iterator[Env]:
    made = Env()
    try:
        yield made
    finally:
        made.close()


def test_the_owner_consumes_on_until_its_heir_takes_the_claim_then_cancels(env: Env) -> None:
    # When p0 moves to b, which hands over by priority too
    a, broker = env.yielded()
    # Then a consumes on: nothing cancelled, the claim unchanged
    assert a.slots[0].state.phase is Phase.YIELDING
    assert not broker.named("cancel")
    assert a.owned() == [0]
    # When b takes the claim over (the broker switched to it)
    claim, seen = env.group.read_claim(0)
    assert claim is not None and not claim.sealed
    assert env.group.take_over(0, "b", env.sessions["b"], seen, priority=1) > 0
    a.follow(env.group.snapshot())
    # Then a cancels at once, as a consumer waiting behind b's (nothing is checked out to
    # it: no fillers, no quiet spell), without sealing b's claim (its heir no longer able to
    # take it, then the claim b's: each says so)
    assert a.slots[0].state.phase is Phase.DRAINING
    assert broker.named("cancel") == [("cancel", 0, "waiting")] * 2
    after, _ = env.group.read_claim(0)
    assert after is not None and (after.member, after.priority, after.sealed) == ("b", 1, False)


def test_an_owner_draining_when_its_heir_takes_the_claim_cancels_at_once(env: Env) -> None:
    # Given p0 yielded to b, then unassigned (a drain begun) just as the broker switched
    a, broker = env.yielded()
    env.assign("c")
    a.follow(env.group.snapshot())
    assert broker.named("cancel") == [("cancel", 0)]
    # When b takes the claim over (the broker had switched to it)
    claim, seen = env.group.read_claim(0)
    assert claim is not None
    assert env.group.take_over(0, "b", env.sessions["b"], seen, priority=1) > 0
    a.follow(env.group.snapshot())
    # Then a's drain is told its consumer waits behind b's: cancelled at once
    assert a.slots[0].state.phase is Phase.DRAINING
    assert broker.named("cancel") == [("cancel", 0), ("cancel", 0, "waiting")]


def test_an_owner_moved_to_a_member_that_drains_seals_its_claim_before_the_cancel(env: Env) -> None:
    a, broker = env.yielded()
    assert a.slots[0].state.phase is Phase.YIELDING
    # When p0 moves on to c, which hands over by drain / Then a seals its claim, then cancels
    env.assign("c")
    a.follow(env.group.snapshot())
    claim, _ = env.group.read_claim(0)
    assert claim is not None and (claim.member, claim.sealed) == ("a", True)
    assert (a.slots[0].state.phase, broker.named("cancel")) == (Phase.DRAINING, [("cancel", 0)])


def test_the_heir_subscribes_above_the_owner_and_takes_the_claim_once_switched(env: Env) -> None:
    b, broker = env.heir()
    slot = b.slots[0]
    # Then b waits for a's claim as its heir: subscribed one above a's priority (0)
    assert (slot.state.phase, slot.state.standby) == (Phase.WAITING, Standby.STANDING)
    assert broker.named("stand_by") == [("stand_by", 0, 1)]
    _, seen = env.group.read_claim(0)
    assert (slot.behind.owner, slot.behind.seen, slot.behind.rank) == ("a", seen, 1)
    # When RabbitMQ switches to it / Then the claim is b's, with its priority, and promoted
    assert b.standbys.activated(0) is True
    b.standbys.check()
    claim, _ = env.group.read_claim(0)
    assert claim is not None and (claim.member, claim.priority, claim.sealed) == ("b", 1, False)
    assert (slot.state.phase, slot.state.holder) == (Phase.ACTIVE, Holder.ME)
    assert [c[0] for c in broker.calls][-1] == "promote"


def test_an_heir_activated_by_a_cancel_behind_a_sealed_claim_gives_back_and_waits(
    env: Env,
) -> None:
    b, broker = env.heir()
    # When a seals its claim (a drain: its cancel activates b while it still handles)
    claim, _ = env.group.read_claim(0)
    assert claim is not None
    assert env.group.seal(0, env.sessions["a"], claim) > 0
    b.standbys.activated(0)
    b.standbys.check()
    # Then b gives everything back, keeps waiting, and does not subscribe as heir again
    b.follow(env.group.snapshot())
    slot = b.slots[0]
    assert (slot.state.phase, slot.state.standby) == (Phase.WAITING, Standby.NONE)
    assert broker.named("give_back") == [("give_back", 0)]
    assert len(broker.named("stand_by")) == 1
    assert env.group.read_claim(0)[0].member == "a"  # type: ignore[union-attr]
    # When a releases / Then b claims and subscribes as usual, at the freed claim's priority
    env.group.release(0, env.sessions["a"])
    b.follow(env.group.snapshot())
    assert slot.state.phase is Phase.SUBSCRIBING
    assert broker.named("subscribe") == [("subscribe", 0, 1, 0)]


def test_no_heir_behind_a_member_that_hands_over_by_drain(env: Env) -> None:
    env.group.claim(0, "c", env.sessions["c"])
    env.assign("b")
    b, broker = env.side("b")
    b.follow(env.group.snapshot())
    assert (b.slots[0].state.phase, broker.named("stand_by")) == (Phase.WAITING, [])


def test_an_owner_whose_heir_does_not_take_over_in_time_seals_and_drains(env: Env) -> None:
    a, broker = env.owner()
    yields: list[float] = []
    a.yielding._later = lambda _p, since: yields.append(since)  # the daemon's deadline
    env.assign("b")
    a.follow(env.group.snapshot())
    assert a.slots[0].state.phase is Phase.YIELDING and len(yields) == 1
    # When an earlier yield's timer fires / Then nothing
    a.later(StopYielding(0, yields[0] - 1.0))
    assert (a.slots[0].state.phase, broker.named("cancel")) == (Phase.YIELDING, [])
    # When this yield's fires while a's worker still handles a delivery / Then it waits on
    worker = a.slots[0].worker
    assert worker is not None
    worker.waiting_since = None
    a.later(StopYielding(0, yields[0]))
    assert (a.slots[0].state.phase, broker.named("cancel"), yields[-1]) == (
        Phase.YIELDING,
        [],
        yields[0],
    )
    # When it fires with the worker idle for a while (an idle queue: nothing proves the
    # switch to the heir)
    worker.waiting_since = time.monotonic() - 10
    a.later(StopYielding(0, yields[0]))
    # Then a seals its claim, then cancels: a drain
    claim, _ = env.group.read_claim(0)
    assert claim is not None and (claim.member, claim.sealed) == ("a", True)
    assert (a.slots[0].state.phase, broker.named("cancel")) == (Phase.DRAINING, [("cancel", 0)])


def test_an_heir_moved_away_keeps_standing_and_takes_over_if_the_broker_switched(
    env: Env,
) -> None:
    b, broker = env.heir()
    # When the assignment flaps back to a (the claim unchanged)
    env.assign("a")
    b.follow(env.group.snapshot())
    # Then b stays subscribed above a: the broker may have switched to it already
    assert (b.slots[0].state.standby, broker.named("stand_down")) == (Standby.STANDING, [])
    # When it had: the claim is b's all the same (it moves on from b as any partition)
    b.standbys.activated(0)
    b.standbys.check()
    claim, _ = env.group.read_claim(0)
    assert claim is not None and claim.member == "b"
    assert not broker.named("give_back")
    # and b, not assigned p0, yields it to a at once (a hands over by priority too)
    assert b.slots[0].state.phase is Phase.YIELDING


def test_an_owner_whose_heir_took_over_as_it_was_assigned_back_subscribes_above_it(
    env: Env,
) -> None:
    a, broker = env.yielded()
    _, seen = env.group.read_claim(0)
    assert env.group.take_over(0, "b", env.sessions["b"], seen, priority=1) > 0
    env.assign("a")  # the leader's flap: a again, but b holds the claim now
    a.follow(env.group.snapshot())
    assert a.slots[0].state.phase is Phase.DRAINING
    # When a's drain ends (nothing was checked out to it)
    a.handoff(0, Event.DRAINED)
    # Then a waits for b's claim as its heir, one above b's priority
    assert (a.slots[0].state.phase, a.slots[0].state.standby) == (Phase.WAITING, Standby.STANDING)
    assert broker.named("stand_by") == [("stand_by", 0, 2)]


def test_an_heir_takes_over_a_claim_its_owner_rewrote_without_sealing(env: Env) -> None:
    b, broker = env.heir()
    # When a marks its claim live after b subscribed behind it (b has not seen the rewrite)
    claim, seen = env.group.read_claim(0)
    assert claim is not None and not claim.live
    assert env.group.mark_live(0, env.sessions["a"], claim) > seen
    # and RabbitMQ switches to b / Then b takes that claim over: a cancelled nothing
    b.standbys.activated(0)
    b.standbys.check()
    after, _ = env.group.read_claim(0)
    assert after is not None and (after.member, after.priority) == ("b", 1)
    assert (b.slots[0].state.phase, broker.named("give_back")) == (Phase.ACTIVE, [])
