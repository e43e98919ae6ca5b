"""The consumer daemon's logic with no servers: a FakeEtcd and a StubBroker around a real Consumer.

The tests play the leader by writing assignment keys into the fake, and the broker through
the stub; the Consumer runs in a thread as ``partq consume`` runs it, with real partition
workers and real sessions (TTL 1 s, so a lost lease is noticed within a third of that).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from partq.consumers.control.daemon import (
    EXIT_OK,
    EXIT_PERMISSION_DENIED,
    EXIT_STREAM_CHANGED,
    EXIT_WORKER_FAILED,
    Consumer,
    ConsumerConfig,
)
from partq.consumers.handling.message import Message
from partq.consumers.state.handoff import Phase
from partq.coordinator.leader import resize
from partq.coordinator.store import codec
from partq.coordinator.store.events import LeaseLost
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import OnFailure, StreamSpec
from partq.producer.layout import Layout
from partq.producer.registry import Registry

from partq.kernel import keys
from tests.fakes.broker import StubBroker
from tests.fakes.etcd import FakeEtcd
from tests.members import claim_live
from tests.polling import eventually

P = 4


class Running:
    """A Consumer of the env's stream, running in a thread, with a StubBroker."""

    def __init__(self, env: Env, member: str | None, **config: Any) -> None:
        self.env = env
        self.handled: list[bytes] = []
        options = {"ttl": 1, "drain_timeout": 5.0, **config}
        self.consumer = Consumer(
            env.registry,
            self.handle,
            ConsumerConfig(env.stream, member_id=member, **options),
            broker=StubBroker,
        )
        self.broker: StubBroker = self.consumer.broker  # type: ignore[assignment]
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"consumer-{member}", daemon=True)
        self.thread.start()
        eventually(f"{member} ready", self.consumer.ready.is_set)

    def handle(self, message: Message) -> None:
        self.handled.append(message.body)

    def _run(self) -> None:
        self.code = self.consumer.run()

    @property
    def lease(self) -> int:
        session = self.consumer.session
        assert session is not None
        return session.id

    def phase(self, partition: int) -> Phase:
        return self.consumer.partitions.slots[partition].state.phase

    def stop(self) -> int | None:
        if self.thread.is_alive():
            self.consumer.stop()
            self.thread.join(10)
        return self.code


class Env:
    def __init__(self, on_failure: OnFailure = "dead-letter") -> None:
        self.fake = FakeEtcd()
        self.registry = Registry(self.fake, "fake")
        self.stream = f"s-{uuid.uuid4().hex[:8]}"
        self.registry.create(StreamSpec(self.stream, P, on_failure=on_failure))
        self.group = Group(self.fake, "fake", self.stream)
        self.running: list[Running] = []

    def consumer(self, member: str | None, **config: Any) -> Running:
        running = Running(self, member, **config)
        self.running.append(running)
        return running

    def assign(self, partition: int, member: str) -> None:
        """What the leader does."""
        self.fake.put(keys.assignment(self.stream, partition), codec.encode_assignment(member))

    def claim_of(self, partition: int) -> tuple[str, int] | None:
        """(member, lease) of the partition's claim in etcd."""
        claim = self.group.snapshot().claims.get(partition)
        return None if claim is None else (claim.member, claim.lease)

    def close(self) -> None:
        for running in self.running:
            running.stop()


@pytest.fixture
def env() -> Iterator[Env]:
    made = Env()
    yield made
    made.close()


def consuming(env: Env, member: str, *partitions: int) -> Running:
    """A consumer that is consuming ``partitions`` (assigned, claimed, subscribed)."""
    running = env.consumer(member)
    for partition in partitions:
        env.assign(partition, member)
    eventually("consuming", lambda: running.consumer.owned() == sorted(partitions))
    return running


def claims_at_subscribe(env: Env, running: Running) -> list[tuple[str, int] | None]:
    """The partition's claim in etcd each time ``running`` subscribes, as it subscribes."""
    seen: list[tuple[str, int] | None] = []
    subscribe = running.broker.subscribe

    def checking(partition: int, generation: int, *args: Any, **kwargs: Any) -> bool:
        seen.append(env.claim_of(partition))
        return subscribe(partition, generation, *args, **kwargs)

    running.broker.subscribe = checking  # type: ignore[method-assign]
    return seen


def own_claims(running: Running) -> list[int]:
    """The partitions ``running`` claims itself (etcd put-if-absent), in order."""
    claimed: list[int] = []
    group = running.consumer.partitions.group
    claim = group.claim

    def counting(partition: int, member: str, session: Session) -> int:
        claimed.append(partition)
        return claim(partition, member, session)

    group.claim = counting  # type: ignore[method-assign]
    return claimed


def test_an_assigned_partition_is_claimed_then_subscribed(env: Env) -> None:
    # Given a running member, and a broker that checks the claim is there at subscribe time
    c1 = env.consumer("c1")
    claimed_at_subscribe = claims_at_subscribe(env, c1)
    # When the leader assigns it partition 2
    env.assign(2, "c1")
    # Then it claims it on its lease, then subscribes, then consumes
    eventually("consuming", lambda: c1.consumer.owned() == [2])
    assert claimed_at_subscribe == [("c1", c1.lease)]
    assert env.claim_of(2) == ("c1", c1.lease)
    assert c1.broker.subscribed() == {2}
    # And what the broker delivers is handled and acked
    tags = [c1.broker.publish(2, f"m{i}".encode()) for i in range(3)]
    eventually("handled", lambda: c1.broker.acked(2) == tags)
    assert c1.handled == [b"m0", b"m1", b"m2"]


def test_a_member_started_without_an_id_joins_and_consumes_under_the_one_it_chose(
    env: Env,
) -> None:
    # Given a member started without a member id (the README's quick start)
    running = env.consumer(None)
    member = running.consumer.member
    # Then the group knows it by the id it uses itself
    eventually("joined", lambda: member in env.group.snapshot().members)
    # and a partition the leader assigns to that id is claimed and consumed
    env.assign(1, member)
    eventually("consuming", lambda: running.consumer.owned() == [1])
    assert env.claim_of(1) == (member, running.lease)


def test_a_partition_claimed_by_another_member_waits_for_its_release(env: Env) -> None:
    # Given partition 1 still claimed by its previous owner
    other = Session(env.fake, "fake", ttl=5)
    try:
        assert env.group.claim(1, "old", other)
        c1 = env.consumer("c1")
        # When it is assigned to c1 / Then c1 waits, and does not subscribe
        env.assign(1, "c1")
        eventually("waiting", lambda: c1.phase(1) is Phase.WAITING)
        time.sleep(0.1)
        assert c1.broker.count("subscribe", 1) == 0
        assert c1.broker.count("warm", 1) == 1  # a channel ready, nothing consumed
        # When the old owner releases it / Then c1 claims it and consumes
        env.group.release(1, other)
        eventually("consuming", lambda: c1.consumer.owned() == [1])
        assert env.claim_of(1) == ("c1", c1.lease)
    finally:
        other.close()


def test_a_revoked_partition_is_cancelled_drained_then_released(env: Env) -> None:
    # Given c1 consuming partition 0, with a broker that lets the test end the cancel
    c1 = consuming(env, "c1", 0)
    c1.broker.auto = False
    tags = [c1.broker.publish(0, f"m{i}".encode()) for i in range(3)]
    # When the leader gives the partition to c2
    env.assign(0, "c2")
    # Then c1 cancels its subscription and keeps its claim while the drain runs
    eventually("the cancel", lambda: c1.broker.count("cancel", 0) == 1)
    eventually("draining", lambda: c1.phase(0) is Phase.DRAINING)
    time.sleep(0.1)
    assert env.claim_of(0) == ("c1", c1.lease)
    # When the broker has sent everything / Then c1 handles and acks it all, then releases
    c1.broker.end(0)
    eventually("the release", lambda: env.claim_of(0) is None)
    assert c1.broker.acked(0) == tags and len(c1.handled) == 3
    assert c1.broker.count("finish", 0) == 1
    assert c1.phase(0) is Phase.IDLE and c1.consumer.owned() == []


def test_an_emptied_drain_releases_the_claim_before_the_cut(env: Env) -> None:
    # Given c1 consuming partition 0, with a broker that lets the test end the drain,
    # and that records whether the claim is still there when it is told to cut
    c1 = consuming(env, "c1", 0)
    c1.broker.auto = False
    claim_at_cut: list[tuple[str, int] | None] = []
    cut = c1.broker.cut

    def checking(partition: int) -> None:
        claim_at_cut.append(env.claim_of(partition))
        cut(partition)

    c1.broker.cut = checking  # type: ignore[method-assign]
    tags = [c1.broker.publish(0, f"m{i}".encode()) for i in range(3)]
    eventually("handled", lambda: len(c1.handled) == 3)
    # When the leader gives the partition to c2 and the broker reports the drain emptied
    env.assign(0, "c2")
    eventually("draining", lambda: c1.phase(0) is Phase.DRAINING)
    assert env.claim_of(0) == ("c1", c1.lease)  # kept while the window fills
    c1.broker.empty(0)
    # Then c1 releases the claim first, then cuts (no END to the worker), and is done
    eventually("idle", lambda: c1.phase(0) is Phase.IDLE)
    assert claim_at_cut == [None]
    assert c1.broker.count("cut", 0) == 1 and c1.broker.count("finish", 0) == 0
    assert c1.broker.acked(0) == tags
    assert c1.consumer.owned() == []


def test_a_partition_assigned_back_while_draining_is_kept_without_a_cancel(env: Env) -> None:
    # Given c1 consuming partition 0 with c3 its hot standby, and a broker that lets the
    # test answer (seen after a takeover: the leader moved the partition away and back
    # within 15 ms; c1 cancelled, released, claimed and subscribed again, and c3, standing
    # by behind c1 meanwhile, was activated by that cancel and gave a window back out of order)
    c1 = consuming(env, "c1", 0)
    env.fake.put(keys.standby(env.stream, 0), codec.encode_standby("c3"))
    c1.broker.auto = False
    tags = [c1.broker.publish(0, f"m{i}".encode()) for i in range(3)]
    eventually("handled", lambda: len(c1.handled) == 3)
    # When the leader moves it to c2 and back to c1 while c1's drain holds its acks
    env.assign(0, "c2")
    eventually("draining", lambda: c1.phase(0) is Phase.DRAINING)
    env.assign(0, "c1")
    # Then c1 calls the drain off instead of cutting it when it empties
    eventually("the drain called off", lambda: c1.broker.count("resume", 0) >= 1)
    c1.broker.empty(0)
    c1.broker.keep(0)
    eventually("consuming on", lambda: c1.phase(0) is Phase.ACTIVE)
    assert c1.broker.count("cut", 0) == 0 and c1.broker.count("cancel", 0) == 1
    assert c1.broker.count("subscribe", 0) == 1  # never subscribed again
    assert env.claim_of(0) == ("c1", c1.lease)  # never released
    assert c1.broker.acked(0) == tags
    more = [c1.broker.publish(0, b"after")]
    eventually("handled on", lambda: c1.broker.acked(0) == tags + more)


def test_a_revoked_claim_is_handed_to_the_next_owner_which_need_not_claim(env: Env) -> None:
    # Given c1 consuming partition 0, and c2 a member that counts its own claims
    c1 = consuming(env, "c1", 0)
    c2 = env.consumer("c2")
    claims = own_claims(c2)
    claimed_at_subscribe = claims_at_subscribe(env, c2)
    # When the leader moves the partition to c2
    env.assign(0, "c2")
    # Then c1 drains, and its release hands the claim to c2, on c2's lease
    eventually("c2 consuming", lambda: c2.consumer.owned() == [0])
    assert claimed_at_subscribe == [("c2", c2.lease)]
    assert claims == []  # c2 never had to claim it itself
    assert c1.phase(0) is Phase.IDLE and c1.consumer.owned() == []
    tags = [c2.broker.publish(0, b"after")]
    eventually("handled by c2", lambda: c2.broker.acked(0) == tags)


def test_a_claim_is_deleted_not_handed_over_while_the_partition_has_a_standby(
    env: Env,
) -> None:
    # Given c1 consuming partition 0, c2 a member, and c3 named 0's hot standby
    c1 = consuming(env, "c1", 0)
    c2 = env.consumer("c2")
    env.fake.put(keys.standby(env.stream, 0), codec.encode_standby("c3"))
    eventually("c1 sees the standby", lambda: 0 in c1.consumer.partitions.mirror.standbys)
    claims = own_claims(c2)
    claimed_at_subscribe = claims_at_subscribe(env, c2)
    # When the leader moves the partition to c2
    env.assign(0, "c2")
    # Then c1 deletes its claim (a standby activated by its cancel must find no live
    # owner's claim), and c2 claims it itself
    eventually("c2 consuming", lambda: c2.consumer.owned() == [0])
    assert claimed_at_subscribe == [("c2", c2.lease)]
    assert claims == [0]
    assert c1.consumer.owned() == []


def test_a_malformed_assignment_is_no_assignment(env: Env) -> None:
    c1 = consuming(env, "c1", 3)
    env.fake.put(keys.assignment(env.stream, 3), "{garbage")
    eventually("the release", lambda: env.claim_of(3) is None)
    assert c1.broker.count("cancel", 3) == 1
    # and one that is fine again is followed again
    env.assign(3, "c1")
    eventually("consuming again", lambda: c1.consumer.owned() == [3])


def test_a_frozen_member_fences_instead_of_draining_what_the_watch_shows_gone(
    env: Env,
) -> None:
    # Given c1 consuming two partitions, then frozen: its lease not renewed since
    c1 = consuming(env, "c1", 0, 1)
    session = c1.consumer.session
    assert session is not None
    session._closed.set()  # the refresher stops, as in a freeze
    session._thread.join(5)
    session.last_tick -= 10
    # When etcd expires its lease and the watch shows its claims gone before any renewal
    env.fake.expire(c1.lease)
    # Then it asks etcd, finds the lease lost, and fences: no partition is cancelled (a
    # cancel lets the next owner be served newer messages before the ones it holds)
    eventually("the fence", lambda: c1.broker.count("fence") == 1)
    assert c1.broker.count("cancel", 0) == 0 and c1.broker.count("cancel", 1) == 0


def test_a_lost_lease_fences_every_partition_then_the_member_rejoins(env: Env) -> None:
    # Given c1 consuming two partitions
    c1 = consuming(env, "c1", 0, 1)
    first = c1.lease
    # When etcd expires its lease (its member key and claims go with it: the watch may
    # tell of the claims first, and a drain begin)
    env.fake.expire(first)
    # Then once its session hears of it, it drops every channel at once, and rejoins
    eventually("the fence", lambda: c1.broker.count("fence") == 1)
    eventually("a new lease", lambda: c1.consumer.session is not None and c1.lease != first)
    eventually("the member back", lambda: "c1" in env.group.snapshot().members)
    assert env.fake.lease_of(keys.member(env.stream, "c1")) == c1.lease
    # And it claims its partitions again, on the new lease, and consumes them
    eventually("consuming again", lambda: c1.consumer.owned() == [0, 1])
    assert env.claim_of(0) == ("c1", c1.lease) and env.claim_of(1) == ("c1", c1.lease)
    assert c1.broker.count("subscribe", 0) == 2


def test_a_lost_lease_reported_again_after_the_rejoin_fences_nothing_more(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # Given c1 fenced once for its lost lease and consuming again on a new one
    c1 = consuming(env, "c1", 0, 1)
    first = c1.lease
    env.fake.expire(first)
    eventually("the fence", lambda: c1.broker.count("fence") == 1)
    eventually("consuming again", lambda: c1.lease != first and c1.consumer.owned() == [0, 1])
    second = c1.lease
    # When the first lease's loss is reported once more (a late report of the old session)
    caplog.set_level(logging.DEBUG, logger="partq.consumer")
    c1.consumer.events.put(LeaseLost(first))
    # Then it is passed over: the new session's partitions are not fenced for it
    eventually("the late report", lambda: f"lease {first:x} was lost, but" in caplog.text)
    assert c1.broker.count("fence") == 1
    assert c1.lease == second and c1.consumer.owned() == [0, 1]


class Holding:
    """A handler that holds message ``m0`` until released, noting how many fences the
    broker had seen when it returned."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.fences_at_return: int | None = None
        self.handled: list[bytes] = []
        self.running: Running | None = None

    def __call__(self, message: Message) -> None:
        self.handled.append(message.body)
        if message.body == b"m0":
            self.started.set()
            self.release.wait(10)
            assert self.running is not None
            self.fences_at_return = self.running.broker.count("fence")


def inside_a_call(env: Env, ttl: int, messages: int) -> tuple[Running, Holding, list[int]]:
    """c1 consuming partition 0 with a :class:`Holding` handler, sent ``messages`` (m0 …)
    and inside its call for m0; the delivery tags."""
    holding = Holding()
    c1 = env.consumer("c1", ttl=ttl)
    c1.consumer.partitions.crew.handler = holding
    holding.running = c1
    env.assign(0, "c1")
    eventually("consuming", lambda: c1.consumer.owned() == [0])
    tags = [c1.broker.publish(0, f"m{i}".encode()) for i in range(messages)]
    eventually("m0 under way", holding.started.is_set)
    return c1, holding, tags


def test_a_handler_call_under_way_at_a_lost_lease_finishes_before_the_fence(
    env: Env,
) -> None:
    # Given c1 inside its handler for m0 (m1 waiting behind it), as a process frozen
    # mid-call and resumed past its lease would be
    c1, holding, tags = inside_a_call(env, ttl=2, messages=2)
    worker = c1.consumer.partitions.slots[0].worker
    assert worker is not None
    # When its lease is lost and the daemon begins the fence (the worker stopped for it)
    env.fake.expire(c1.lease)
    eventually("the fence begun", lambda: worker._fencing)
    assert c1.broker.count("fence") == 0
    holding.release.set()
    # Then the call finishes and m0 is acked before the connection is aborted; m1 is never
    # begun nor given back by a channel close: the abort returns it, in order
    eventually("the fence", lambda: c1.broker.count("fence") == 1)
    assert holding.fences_at_return == 0
    assert c1.broker.acked(0) == tags[:1]
    assert holding.handled == [b"m0"]
    assert c1.broker.count("close_channel", 0) == 0


def test_a_handler_call_still_under_way_a_lease_ttl_on_is_fenced_anyway(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # Given c1 (lease TTL 1 s) inside its handler for m0
    c1, holding, _tags = inside_a_call(env, ttl=1, messages=1)
    # When its lease is lost and the call does not return
    env.fake.expire(c1.lease)
    # Then the fence waits a lease TTL for it, no longer, and says so
    eventually("the fence", lambda: c1.broker.count("fence") == 1)
    holding.release.set()
    eventually("m0 returned", lambda: holding.fences_at_return is not None)
    assert holding.fences_at_return == 1
    assert "a handler call is still under way 1s after the fence began" in caplog.text


def test_a_stop_leaves_the_group_drains_releases_and_revokes(env: Env) -> None:
    # Given c1 consuming two partitions, with a broker that notes who is a member at cancel
    c1 = consuming(env, "c1", 0, 2)
    lease = c1.lease
    for partition in (0, 2):
        c1.broker.publish(partition, b"x")
    members_at_cancel: list[set[str]] = []
    cancel = c1.broker.cancel

    def noting(partition: int, *, waiting: bool = False) -> None:
        members_at_cancel.append(set(env.group.snapshot().members))
        cancel(partition, waiting=waiting)

    c1.broker.cancel = noting  # type: ignore[method-assign]
    # When it is stopped
    code = c1.stop()
    # Then it left the group first, drained and released both, revoked its lease, exits 0
    assert code == EXIT_OK
    assert members_at_cancel == [set(), set()]
    assert c1.broker.count("finish", 0) == 1 and c1.broker.count("finish", 2) == 1
    assert len(c1.handled) == 2 and c1.broker.acked(0) and c1.broker.acked(2)
    state = env.group.snapshot()
    assert "c1" not in state.members and state.claims == {}
    assert lease not in env.fake.leases()
    assert c1.broker.stopped.is_set()


def test_a_delivery_of_an_earlier_subscription_never_reaches_the_newer_worker(env: Env) -> None:
    # Given c1 consuming partition 1, whose channel is lost and subscribed again
    c1 = consuming(env, "c1", 1)
    old = c1.broker.generations[1]
    c1.broker.lose_channel(1)
    eventually("subscribed again", lambda: c1.broker.count("subscribe", 1) == 2)
    eventually("consuming", lambda: c1.consumer.owned() == [1])
    assert c1.broker.generations[1] != old
    # When a delivery of the earlier subscription arrives (say, read off its connection
    # late), then one of the current subscription
    c1.broker.publish(1, b"old", generation=old)
    c1.broker.publish(1, b"new")
    # Then the new worker handles only its own
    eventually("handled", lambda: c1.handled == [b"new"])
    assert c1.broker.acked(1) == [2]


def test_a_lost_channel_resubscribes_and_a_lost_connection_waits_for_the_broker(env: Env) -> None:
    c1 = consuming(env, "c1", 1)
    c1.broker.lose_channel(1)
    eventually("subscribed again", lambda: c1.broker.count("subscribe", 1) == 2)
    eventually("consuming", lambda: c1.consumer.owned() == [1])
    # When the connection drops / Then it is not ready, and subscribes once it is back
    c1.broker.disconnect()
    eventually("not ready", lambda: not c1.consumer.ready.is_set())
    eventually("waiting for the broker", lambda: c1.phase(1) is Phase.SUBSCRIBING)
    c1.broker.reconnect()
    eventually("consuming again", lambda: c1.consumer.owned() == [1])
    assert c1.consumer.ready.is_set() and env.claim_of(1) == ("c1", c1.lease)


def test_a_broker_unusable_past_the_outage_limit_makes_the_member_leave_until_it_works(
    env: Env,
) -> None:
    # Given c1 consuming two partitions, with an outage limit of 1 s
    c1 = env.consumer("c1", amqp_outage_limit=1.0)
    for partition in (0, 1):
        env.assign(partition, "c1")
    eventually("consuming", lambda: c1.consumer.owned() == [0, 1])
    first = c1.lease
    # When the broker connection drops and stays down
    c1.broker.disconnect()
    # Then it is unready at once, and past the limit it leaves: member key, claims and lease
    eventually("not ready", lambda: not c1.consumer.ready.is_set())
    assert "c1" in env.group.snapshot().members  # within the limit it stays
    eventually("left", lambda: "c1" not in env.group.snapshot().members, timeout=5)
    assert env.group.snapshot().claims == {} and first not in env.fake.leases()
    assert not c1.consumer.ready.is_set()
    # And once the broker works again it rejoins and consumes what is assigned to it
    c1.broker.reconnect()
    eventually("back", lambda: "c1" in env.group.snapshot().members)
    eventually("consuming again", lambda: c1.consumer.owned() == [0, 1])
    assert c1.lease != first and c1.consumer.ready.is_set()
    assert c1.stop() == EXIT_OK


def test_a_stop_while_the_broker_is_away_ends_within_the_drain_timeout(env: Env) -> None:
    # Given c1 consuming two partitions, and its broker connection gone (within the limit)
    c1 = consuming(env, "c1", 0, 1)
    c1.broker.disconnect()
    eventually("not ready", lambda: not c1.consumer.ready.is_set())
    # When it is stopped / Then it leaves at once and exits 0, well within its 5 s drain
    started = time.monotonic()
    assert c1.stop() == EXIT_OK
    assert time.monotonic() - started < 2
    assert env.group.snapshot().members == {} and env.group.snapshot().claims == {}


class _OfflineBroker(StubBroker):
    """A broker that never becomes usable (a wrong password, say)."""

    def start(self) -> None:
        pass


def test_a_member_without_a_usable_broker_never_joins_and_stops_at_once(env: Env) -> None:
    # Given a consumer whose broker connection never works
    consumer = Consumer(
        env.registry,
        lambda _m: None,
        ConsumerConfig(env.stream, member_id="c1", ttl=1, drain_timeout=5.0),
        broker=_OfflineBroker,
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(consumer.run()), daemon=True)
    thread.start()
    eventually("running", consumer.alive.is_set)
    env.assign(0, "c1")
    # Then it is not a member, claims nothing and is not ready
    time.sleep(0.5)  # what it would have done by now: join, claim (a join takes ms here)
    assert env.group.snapshot().members == {} and env.group.snapshot().claims == {}
    assert not consumer.ready.is_set()
    # And a stop ends it at once
    started = time.monotonic()
    consumer.stop()
    thread.join(5)
    assert codes == [EXIT_OK] and time.monotonic() - started < 2


def test_a_partition_waiting_for_a_park_makes_the_member_unready_until_it_parks() -> None:
    env = Env("park")
    try:
        c1 = consuming(env, "c1", 0)
        stalls = c1.consumer.parking.stalls  # type: ignore[union-attr]
        # When partition 0's worker cannot park a message / Then /readyz turns false
        stalls.failed(0, b"k", RuntimeError("etcd refused"))
        eventually("not ready", lambda: not c1.consumer.ready.is_set())
        # And the load report (partq status) names the partition
        c1.consumer.reports.report_load(c1.consumer.session)
        assert env.group.loads()["c1"].parking_stalled == (0,)
        # When it parks / Then ready again
        stalls.ended(0, parked=True)
        eventually("ready again", c1.consumer.ready.is_set)
    finally:
        env.close()


def test_a_failed_worker_makes_the_member_leave_and_exit_4(env: Env) -> None:
    c1 = consuming(env, "c1", 0, 1)

    def failing_ack(partition: int, channel: Any, tag: int) -> None:
        raise RuntimeError("injected: the ack failed")

    c1.broker.ack = failing_ack  # type: ignore[method-assign]
    c1.broker.publish(0, b"x")
    c1.thread.join(10)
    assert c1.code == EXIT_WORKER_FAILED
    assert c1.broker.count("cancel", 1) == 1 and c1.broker.count("cancel", 0) == 0
    state = env.group.snapshot()
    assert "c1" not in state.members and state.claims == {}


def test_a_refused_queue_makes_the_member_unready_leave_and_exit_6(env: Env) -> None:
    # Given a member consuming partitions 0 and 1
    c1 = consuming(env, "c1", 0, 1)
    # When RabbitMQ refuses it partition 1's queue (403)
    c1.broker.refuse(1, "permission denied: user 'u' may not read queue 'q'")
    # Then it is not ready, partition 1 is never subscribed again, 0 is drained, and it
    # leaves the group and exits 6
    c1.thread.join(10)
    assert c1.code == EXIT_PERMISSION_DENIED
    assert not c1.consumer.ready.is_set()
    assert c1.broker.count("subscribe", 1) == 1
    assert c1.broker.count("cancel", 0) == 1 and c1.broker.count("cancel", 1) == 0
    state = env.group.snapshot()
    assert "c1" not in state.members and state.claims == {}


def test_a_deleted_stream_stops_everything_and_another_partition_count_exits_5(
    env: Env,
) -> None:
    c1 = consuming(env, "c1", 0)
    # When the stream is deleted / Then every partition stops and the member is not ready
    env.registry.delete(env.stream)
    eventually("not ready", lambda: not c1.consumer.ready.is_set())
    eventually("dropped", lambda: c1.broker.count("fence") == 1)
    assert c1.consumer.owned() == []
    # When it is created again with another partition count / Then the member exits 5
    env.registry.create(StreamSpec(env.stream, P + 1))
    c1.thread.join(10)
    assert c1.code == EXIT_STREAM_CHANGED


def test_a_member_reports_what_it_handled_per_partition(env: Env) -> None:
    # Given a member reporting its load every 0.2 s, consuming partitions 1 and 3, and every report
    # it puts collected
    reports: list[codec.LoadReport] = []

    def collect(response: Any) -> None:
        for event in getattr(response, "events", []):
            if event.value:
                reports.append(codec.decode_load("c1", event.value))

    env.fake.add_watch_prefix_callback(keys.loads(env.stream), collect)
    c1 = env.consumer("c1", load_report=0.2)
    env.assign(1, "c1")
    env.assign(3, "c1")
    eventually("consuming", lambda: c1.consumer.owned() == [1, 3])

    # When the broker delivers 30 messages of partition 1 and none of partition 3
    tags = [c1.broker.publish(1, f"m{i}".encode()) for i in range(30)]
    eventually("handled", lambda: c1.broker.acked(1) == tags)

    # Then its reports in etcd (on its lease) count the 30 for partition 1, none for 3, and
    # the ones that follow go back to 0
    def counted(partition: int) -> float:
        return sum(r.rates.get(partition, 0.0) * r.interval for r in list(reports))

    eventually("reports with partition 1's messages", lambda: counted(1) > 29.5)
    assert counted(1) == pytest.approx(30, abs=0.5) and counted(3) == 0.0
    assert env.fake.lease_of(keys.load(env.stream, "c1")) == c1.lease
    eventually("a quiet report", lambda: env.group.loads()["c1"].total == 0.0)


@pytest.mark.parametrize("suspect", [True, False], ids=["owner-suspect", "owner-alive"])
def test_a_standby_given_the_partition_from_a_suspect_owner_keeps_standing_by(
    env: Env, suspect: bool
) -> None:
    # Given c1 (played by a session) owning partition 1 with c2 named its standby, and c2
    # standing by behind it
    c1 = Session(env.fake, "fake", ttl=30)
    others: list[Session] = [c1]
    try:
        env.group.join(c1, "c1")
        env.assign(1, "c1")
        assert claim_live(env.group, 1, "c1", c1)
        env.fake.put(keys.standby(env.stream, 1), codec.encode_standby("c2"))
        c2 = env.consumer("c2")
        eventually("standing by", lambda: c2.broker.count("stand_by", 1) == 1)
        if suspect:  # c1's connection died: another standby (c3) took partition 2 from it
            c3 = Session(env.fake, "fake", ttl=30)
            others.append(c3)
            env.group.join(c3, "c3")
            env.assign(2, "c1")
            assert env.group.claim(2, "c1", c1)
            _, seen = env.group.read_claim(2)
            assert env.group.take_over(2, "c3", c3, seen, "c1")

        # When the leader gives partition 1 to c2 while c1's claim is still there
        env.assign(1, "c2")
        eventually("waiting for c1's claim", lambda: c2.phase(1) is Phase.WAITING)

        # Then c2 keeps its standby subscription when c1 is a suspect (RabbitMQ activates
        # it as c1's connection is gone), and stands down for an ordinary planned move
        assert c2.broker.count("stand_down", 1) == (0 if suspect else 1)
    finally:
        for session in others:
            session.close()


def test_a_grown_stream_has_its_added_partitions_consumed(env: Env) -> None:
    # Given a member consuming partition 0 of 4
    running = consuming(env, "m1", 0)
    # When a resize switches the spec to 8 partitions (epoch 1) and assigns it partition 6
    grown = StreamSpec(env.stream, 8, epoch=1)
    env.fake.put(keys.spec(env.stream), grown.to_json())
    env.assign(6, "m1")
    # Then it consumes partition 6 too
    eventually("partition 6 consumed", lambda: running.consumer.owned() == [0, 6])
    assert running.broker.spec.partitions == 8


def test_a_grow_has_its_added_partitions_consumed_from_its_declare_on(env: Env) -> None:
    # Given a member consuming partition 0 of 4
    running = consuming(env, "m1", 0)
    # When a grow to 8 declared its queues (no switch yet) and partition 6 is assigned to it
    state = resize.State(Layout(P).resize(8), resize.Phase.DECLARED)
    env.fake.put(keys.resize(env.stream), resize.encode(state))
    env.assign(6, "m1")
    # Then it consumes partition 6 before the spec changes
    eventually("partition 6 consumed", lambda: running.consumer.owned() == [0, 6])
    assert running.broker.spec.partitions == 8 and running.consumer.epoch == 0


def test_a_member_started_during_a_shrink_consumes_a_retired_partition(env: Env) -> None:
    # Given a shrink 4 -> 2 switched (epoch 1) whose retired partitions still drain
    state = resize.State(Layout(P).resize(2), resize.Phase.SWITCHED)
    env.fake.put(keys.resize(env.stream), resize.encode(state))
    env.fake.put(keys.spec(env.stream), StreamSpec(env.stream, 2, epoch=1).to_json())
    # When a member starts and partition 3 (retired) is assigned to it
    running = env.consumer("m1")
    env.assign(3, "m1")
    # Then it consumes it, until the resize retires
    eventually("partition 3 consumed", lambda: running.consumer.owned() == [3])
