"""A hot standby's way through Partitions, with no servers: a FakeEtcd and a recording broker.

The group is written into the fake as the leader and the partition's owner would write it;
the broker is a recorder of the calls Partitions makes (RabbitMQ's side of a standby is
proven by tests/integration/test_hot_standby.py). Each test drives what the daemon does on
the broker's callbacks: ``standbys.activated`` (``on_activated``), ``standbys.lost``, and
the queued ``standbys.check``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from partq.consumers.state.handoff import Event, Holder, Phase, Standby
from partq.coordinator.store import codec
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd
from tests.members import bare_partitions, claim_live

SPEC = StreamSpec("s", 2)


class RecordingBroker:
    """The broker calls Partitions makes, in order; standing by always succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        def record(partition: int = -1, *_args: object, **_kwargs: object) -> bool:
            self.calls.append((name, partition))
            return True

        return record


class Env:
    """Owner ``a`` consumes p0 on its claim; the leader names ``b`` (us) p0's standby."""

    def __init__(self) -> None:
        self.fake = FakeEtcd()
        self.group = Group(self.fake, "fake", SPEC.name)
        self.a = Session(self.fake, "fake", ttl=5)
        self.b = Session(self.fake, "fake", ttl=5)
        self.group.join(self.a, "a")
        self.group.join(self.b, "b")
        self.assign(0, "a")
        assert claim_live(self.group, 0, "a", self.a) > 0
        self.fake.put(keys.standby(SPEC.name, 0), codec.encode_standby("b"))
        self.broker = RecordingBroker()
        self.settled: list[int] = []
        self.partitions = bare_partitions(
            SPEC, "b", self.group, self.broker, settle_takeover=self.settled.append
        )
        self.partitions.session = self.b
        self.partitions.follow(self.group.snapshot())

    def assign(self, partition: int, member: str) -> None:
        self.fake.put(keys.assignment(SPEC.name, partition), codec.encode_assignment(member))

    def calls(self, name: str) -> int:
        return self.broker.calls.count((name, 0))

    def close(self) -> None:
        self.partitions.stop_workers()
        self.partitions.close()
        self.a.close(revoke=True)
        self.b.close(revoke=True)


@pytest.fixture
def env() -> Iterator[Env]:
    made = Env()
    yield made
    made.close()


def test_the_standby_of_a_dead_owner_takes_over_and_is_promoted(env: Env) -> None:
    # Given a standby subscription behind a's consumer
    slot = env.partitions.slots[0]
    assert (slot.state.standby, slot.behind.owner, env.calls("stand_by")) == (
        Standby.STANDING,
        "a",
        1,
    )
    # When RabbitMQ activates it (a's connection died) / Then one takeover check is queued
    assert env.partitions.standbys.activated(0) is True
    assert slot.state.standby is Standby.ACTIVATED
    # When the check runs / Then our takeover claim is written and the standby promoted
    env.partitions.standbys.check()
    claim = env.group.snapshot().claims[0]
    assert (claim.member, claim.lease, claim.takeover, claim.taken_from) == (
        "b",
        env.b.id,
        True,
        "a",
    )
    assert (slot.state.phase, slot.state.holder, slot.state.standby) == (
        Phase.ACTIVE,
        Holder.ME,
        Standby.NONE,
    )
    assert env.broker.calls[-1] == ("promote", 0) and env.calls("give_back") == 0
    assert slot.worker is not None and slot.worker.is_alive()  # started before the promote
    assert (slot.taken_from, slot.behind.owner, env.settled) == ("a", "", [0])
    assert env.partitions.owned() == [0]
    # and the partition stays ours while the assignment still names a (assigned: taken)
    env.partitions.sync(0)
    assert slot.state.phase is Phase.ACTIVE and slot.taken_from == "a"


def test_an_activation_by_a_planned_move_is_given_back(env: Env) -> None:
    # Given a standing standby whose owner's partition the leader moved (a drains it)
    env.assign(0, "c")
    # When RabbitMQ activates the standby (a's cancel) and the check reads the group
    assert env.partitions.standbys.activated(0) is True
    env.partitions.standbys.check()
    # Then it gives back, claims nothing and starts no worker
    slot = env.partitions.slots[0]
    assert (slot.state.standby, slot.behind.owner, slot.worker) == (Standby.NONE, "", None)
    assert env.calls("give_back") == 1 and env.calls("promote") == 0
    assert env.group.snapshot().claims[0].member == "a"


def test_an_activation_after_the_standby_stood_down_is_given_back_at_once(env: Env) -> None:
    # Given a standby stood down (the leader named another member) before the activation
    env.fake.put(keys.standby(SPEC.name, 0), codec.encode_standby("c"))
    env.partitions.follow(env.group.snapshot())
    assert env.calls("stand_down") == 1
    # When RabbitMQ's activation arrives / Then it goes back at once, with no check queued
    assert env.partitions.standbys.activated(0) is False
    assert env.calls("give_back") == 1
    env.partitions.standbys.check()
    assert env.calls("promote") == 0 and env.calls("give_back") == 1


def test_a_lost_standby_stands_by_again_and_is_not_taken_over_by_an_old_check(
    env: Env,
) -> None:
    # Given an activated standby whose channel then closed before the check
    env.partitions.standbys.activated(0)
    env.partitions.standbys.lost(0)
    # Then it stands by again (still wanted), and the pending check takes nothing over
    slot = env.partitions.slots[0]
    assert (slot.state.standby, env.calls("stand_by")) == (Standby.STANDING, 2)
    env.partitions.standbys.check()
    assert env.calls("promote") == 0 and slot.state.standby is Standby.STANDING


def test_a_stopping_member_gives_every_activated_standby_back(env: Env) -> None:
    env.partitions.standbys.activated(0)
    env.partitions.standbys.check(allowed=False)
    assert env.calls("give_back") == 1 and env.calls("promote") == 0
    assert env.group.snapshot().claims[0].member == "a"


def test_a_fenced_standby_stands_by_again_on_the_next_sync(env: Env) -> None:
    # Given a standing standby behind a's consumer
    assert (env.partitions.slots[0].state.standby, env.calls("stand_by")) == (Standby.STANDING, 1)
    # When our lease is lost and the connection aborted (the standby subscription with it)
    env.partitions.drop()
    assert env.partitions.slots[0].state.standby is Standby.NONE
    # Then the next sync, the leader still naming us, subscribes as the standby again
    env.partitions.sync(0)
    assert (env.partitions.slots[0].state.standby, env.calls("stand_by")) == (Standby.STANDING, 2)


def test_a_standby_given_its_dead_owners_partition_stays_standing_rather_than_turn_heir(
    env: Env,
) -> None:
    # Given members that hand over by priority (RabbitMQ 4 quorum queues), our standby
    # standing behind a on p0, and a turned suspect: c took p1 over from it (a's connection
    # died), while a's member key and its claim on p0 last a lease TTL more
    c = Session(env.fake, "fake", ttl=5)
    env.group.join(c, "c", priority=True)
    for session, member in ((env.a, "a"), (env.b, "b")):  # joined as members that do
        key = keys.member(SPEC.name, member)
        member_key = codec.Member(member, lease=session.id, priority=True)
        env.fake.put(key, codec.encode_member(member_key), lease=session.id)
    env.assign(1, "a")
    assert env.group.claim(1, "a", env.a) > 0
    seen = env.group.snapshot().claim_revisions[1]
    assert env.group.take_over(1, "c", c, seen, "a") > 0
    env.partitions.priority = True
    env.partitions.follow(env.group.snapshot())
    slot = env.partitions.slots[0]
    assert (slot.state.standby, env.calls("stand_by")) == (Standby.STANDING, 1)
    # When the leader gives p0 to us, its standby (partq.coordinator.leader.policy.standing_heirs)
    env.assign(0, "b")
    env.partitions.follow(env.group.snapshot())
    # Then the standby stays: RabbitMQ activates it as it notices a's death and it takes
    # over; standing it down for an heir subscription would give back anything it had
    # been sent already, behind newer messages
    assert (slot.state.standby, slot.behind.owner) == (Standby.STANDING, "a")
    assert (env.calls("stand_down"), env.calls("stand_by")) == (0, 1)
    assert env.partitions.standbys.activated(0) is True
    env.partitions.standbys.check()
    assert env.group.snapshot().claims[0].member == "b"
    assert env.calls("give_back") == 0
    c.close(revoke=True)


def test_an_owner_that_drained_stands_by_behind_the_new_owner_once_idle(env: Env) -> None:
    """On a broker without consumer priorities (RabbitMQ 3.x): the leader names the old
    owner the standby of the partition it just drained, and the new owner marks its claim
    live, both while the drain still waits for its cancel-ok. Nothing in etcd changes after
    that, so the drain's end must itself stand the old owner by (seen in CI: one queue of
    four with its owner's consumer only, and no standby behind it, for 30 s)."""
    # Given b (us) consuming p1 on its live claim, a the standby's owner of p0 as before
    env.assign(1, "b")
    env.partitions.follow(env.group.snapshot())
    env.partitions.handoff(1, Event.SUBSCRIBED)
    slot = env.partitions.slots[1]
    assert slot.state.phase is Phase.ACTIVE and env.group.snapshot().claims[1].live
    # When the leader moves p1 to a: b drains, every delivery handled, the claim handed to a
    env.assign(1, "a")
    env.partitions.follow(env.group.snapshot())
    env.partitions.handoff(1, Event.EMPTIED)
    assert slot.state.phase is Phase.HANDING
    assert env.group.snapshot().claims[1].member == "a"
    # and, before b's cancel-ok, a subscribes and marks the claim live, and the leader
    # names b p1's standby
    claim = env.group.snapshot().claims[1]
    assert env.group.mark_live(1, env.a, claim) > 0
    env.fake.put(keys.standby(SPEC.name, 1), codec.encode_standby("b"))
    env.partitions.follow(env.group.snapshot())
    assert env.broker.calls.count(("stand_by", 1)) == 0  # still handing over: not yet
    # When the drain ends
    env.partitions.handoff(1, Event.DRAINED)
    # Then b stands by behind a at once
    assert slot.state.phase is Phase.IDLE
    assert (slot.state.standby, slot.behind.owner) == (Standby.STANDING, "a")
    assert env.broker.calls.count(("stand_by", 1)) == 1
