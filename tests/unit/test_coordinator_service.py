"""The coordinator service on a FakeEtcd: election, rebalancing, fencing, manual mode, bad values.

Members are played by sessions on the fake (no consumer processes); each test runs real
StreamCoordinator threads, with a short settle, against one in-memory etcd.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import etcd3.exceptions
import etcd3.transactions
import grpc
import pytest
from etcd3.utils import to_bytes
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.store.group import Drain, Group, Move, Rebalance
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry
from prometheus_client import REGISTRY

from partq.kernel import keys
from partq.kernel.errors import StreamNotFound
from tests.fakes.etcd import FakeEtcd
from tests.members import claim_assigned
from tests.polling import eventually

P = 8


class Env:
    """One fake etcd, one stream, members played by sessions, coordinators started on demand."""

    def __init__(self) -> None:
        self.fake = FakeEtcd()
        self.registry = Registry(self.fake, "fake")
        self.stream = f"s-{uuid.uuid4().hex[:8]}"
        self.registry.create(StreamSpec(self.stream, P))
        self.group = Group(self.fake, "fake", self.stream)
        self.sessions: dict[str, Session] = {}
        self.coordinators: list[StreamCoordinator] = []

    def start(self, **config: Any) -> StreamCoordinator:
        config = {"settle": 0.05, "ttl": 1, **config}
        coordinator = StreamCoordinator(self.registry, self.stream, CoordinatorConfig(**config))
        coordinator.start()
        self.coordinators.append(coordinator)
        return coordinator

    def join(self, *members: str) -> None:
        for member in members:
            self.sessions[member] = Session(self.fake, "fake", ttl=5)
            self.group.join(self.sessions[member], member)

    def leave(self, member: str) -> None:
        self.sessions.pop(member).close(revoke=True)

    def claim_assigned(self) -> None:
        claim_assigned(self.group, self.sessions)

    def assignment(self) -> dict[int, str]:
        return self.group.snapshot().assignment

    def counts(self) -> dict[str, int]:
        return dict(Counter(self.assignment().values()))

    def close(self) -> None:
        for coordinator in self.coordinators:
            coordinator.stop()
        for coordinator in self.coordinators:
            coordinator.join(5)
            assert not coordinator.is_alive() and coordinator.failure is None
        for session in self.sessions.values():
            session.close()


@pytest.fixture
def env() -> Iterator[Env]:
    made = Env()
    yield made
    made.close()


def rebalances(stream: str, reason: str) -> float:
    labels = {"stream": stream, "reason": reason}
    return REGISTRY.get_sample_value("partq_coordinator_rebalances_total", labels) or 0.0


# -- election ----------------------------------------------------------------------------------


def test_one_of_two_coordinators_leads_and_the_other_takes_over(env: Env) -> None:
    # Given two coordinators of one stream
    first = env.start()
    assert first.leading.wait(5)
    second = env.start()
    eventually("the second one's candidate", lambda: len(env.group.snapshot().leaders) == 2)
    time.sleep(0.1)
    assert not second.leading.is_set()
    env.join("a")
    eventually("an assignment", lambda: env.counts() == {"a": P})
    # When the leader's lease expires (a crash, a partition from etcd)
    fence = first.election.fence
    assert fence is not None
    env.fake.expire(env.fake.lease_of(fence.key))
    # Then the other one leads, and carries on with the group
    assert second.leading.wait(5)
    env.join("b")
    eventually("the rebalance by the new leader", lambda: env.counts() == {"a": 4, "b": 4})
    # And the old one campaigns again, as a follower now
    eventually("a new candidate", lambda: len(env.group.snapshot().leaders) == 2)
    assert not first.leading.is_set()


# -- rebalancing -------------------------------------------------------------------------------


def test_waits_for_min_members_then_balances_and_follows_joins_and_leaves(env: Env) -> None:
    # Given a coordinator that needs two members
    assert env.start(min_members=2).leading.wait(5)
    env.join("a")
    time.sleep(0.3)  # several settle windows: it must still hold back
    assert env.assignment() == {}
    # When the second joins / Then everything is assigned, balanced
    env.join("b")
    eventually("balance", lambda: env.counts() == {"a": 4, "b": 4})
    # counted once written: the watch can show the assignment before the count
    eventually("the startup counted", lambda: rebalances(env.stream, "startup") == 1)
    # When a third joins / Then each keeps what it can and the newcomer gets its share
    before = env.assignment()
    env.join("c")
    eventually("balance of three", lambda: sorted(env.counts().values()) == [2, 3, 3])
    after = env.assignment()
    assert all(after[p] in (before[p], "c") for p in after)
    eventually("the join counted", lambda: rebalances(env.stream, "membership") == 1)
    # When one leaves / Then its partitions go to the others
    env.leave("a")
    eventually("balance without a", lambda: env.counts() == {"b": 4, "c": 4})


def test_the_settle_window_waits_for_membership_to_stop_changing(env: Env) -> None:
    assert env.start(settle=0.4).leading.wait(5)
    env.join("a")
    time.sleep(0.25)
    env.join("b")  # restarts the window
    time.sleep(0.25)
    assert env.assignment() == {}
    eventually("balance", lambda: env.counts() == {"a": 2 * P // 4, "b": 2 * P // 4})


def test_max_moves_moves_one_step_per_claim(env: Env) -> None:
    # Given a owning and consuming everything
    assert env.start(max_moves=2).leading.wait(5)
    env.join("a")
    eventually("a owns all", lambda: env.counts() == {"a": P})
    env.claim_assigned()
    # When b joins / Then two partitions move, and no more until b claimed them
    env.join("b")
    eventually("the first step", lambda: env.counts() == {"a": 6, "b": 2})
    time.sleep(0.2)
    assert env.counts() == {"a": 6, "b": 2}
    env.claim_assigned()
    eventually("the second step", lambda: env.counts() == {"a": 4, "b": 4})


# -- fencing -----------------------------------------------------------------------------------


def test_a_deposed_leaders_write_is_refused_by_its_fence(env: Env) -> None:
    # Given a leader (manual mode: it writes only on request) held inside its next step
    leader = env.start(manual=True)
    assert leader.leading.wait(5)
    env.join("a")
    held, release = threading.Event(), threading.Event()
    lead = leader._lead

    def holding(event: Any) -> None:
        if leader.mirror.requests and not release.is_set():
            held.set()
            release.wait(5)
        lead(event)

    leader._lead = holding  # type: ignore[method-assign]
    attempts: list[tuple[bool, str]] = []  # (written, the fence's key) of assignment writes
    transaction = env.fake.transaction

    def recording(compare: list[Any], success: Any = None, failure: Any = None) -> Any:
        ok, responses = transaction(compare, success, failure)
        if any(keys.assignments(env.stream) in str(op.key) for op in success or []):
            attempts.append((ok, compare[0].key))
        return ok, responses

    env.fake.transaction = recording  # type: ignore[method-assign]
    env.group.request(Rebalance())
    assert held.wait(5)
    # When it is deposed meanwhile (its lease expires) and it goes on
    fence = leader.election.fence
    assert fence is not None
    env.fake.expire(env.fake.lease_of(fence.key))
    release.set()
    # Then its write is refused; it campaigns again and the next write is fenced anew
    eventually("the assignment", lambda: env.counts() == {"a": P})
    eventually(
        "a write under the new fence",
        lambda: any(ok and key != fence.key for ok, key in list(attempts)),
    )
    assert attempts[0] == (False, fence.key)
    # (a later write may fail too, on a revision that moved meanwhile: retried, not a fence)
    assert not any(ok for ok, key in list(attempts) if key == fence.key)


# -- manual mode and operator requests ---------------------------------------------------------


def test_manual_mode_moves_only_on_operator_requests(env: Env) -> None:
    # Given a manual coordinator and two members: nothing is assigned by itself
    assert env.start(manual=True).leading.wait(5)
    env.join("a", "b")
    time.sleep(0.3)
    assert env.assignment() == {}
    # When an operator asks for a rebalance / Then it happens, and the request is cleared
    env.group.request(Rebalance())
    eventually("the rebalance", lambda: env.counts() == {"a": 4, "b": 4})
    eventually("the request cleared", lambda: env.group.snapshot().requests == {})
    env.claim_assigned()
    # When one of a's partitions is moved to b
    partition = min(p for p, o in env.assignment().items() if o == "a")
    env.group.request(Move(partition, "b"))
    eventually("the move", lambda: env.assignment()[partition] == "b")
    # And a move to a member that is not there is ignored, and cleared
    env.group.request(Move(0, "nobody"))
    eventually("the requests cleared", lambda: env.group.snapshot().requests == {})
    assert env.assignment()[0] != "nobody"
    # When a is drained / Then everything goes to b, and the drain stays until a has left
    env.group.request(Drain("a"))
    eventually("the drain", lambda: env.counts() == {"b": P})
    time.sleep(0.1)
    assert "drain-a" in env.group.snapshot().requests
    env.leave("a")
    eventually("the drain cleared", lambda: env.group.snapshot().requests == {})


# -- values partq did not write ----------------------------------------------------------------


def test_malformed_values_are_ignored_and_a_garbled_assignment_is_rewritten(env: Env) -> None:
    # Given a led, balanced stream
    coordinator = env.start()
    env.join("a", "b")
    eventually("balance", lambda: env.counts() == {"a": 4, "b": 4})
    before = env.assignment()
    # When values partq never writes appear under the stream's keys
    env.fake.put(keys.assignment(env.stream, 3), "{not json")
    env.fake.put(keys.member(env.stream, "ghost"), '{"v": 1, "id": "ghost"}')  # incomplete
    env.fake.put(keys.request(env.stream, "rebalance"), "[]")
    env.fake.put(keys.leader_prefix(env.stream) + "not-a-lease", "")
    # Then the garbled assignment is rewritten as it was, and the rest changes nothing
    eventually("partition 3 rewritten", lambda: env.assignment() == before)
    time.sleep(0.2)
    assert env.assignment() == before and coordinator.leading.is_set()
    assert coordinator.missing is None
    # When the spec itself is garbled / Then the coordinator is not ready until it is back
    env.fake.put(keys.spec(env.stream), "{")
    eventually("not ready", lambda: coordinator.missing is not None)
    with pytest.raises(StreamNotFound, match="missing"):
        coordinator.check()
    env.fake.put(keys.spec(env.stream), StreamSpec(env.stream, P).to_json())
    eventually("ready and leading", lambda: coordinator.missing is None)
    assert coordinator.leading.wait(5)
    coordinator.check()


# -- sessions and etcd -------------------------------------------------------------------------


def test_a_lost_lease_or_an_etcd_outage_ends_the_campaign_and_it_campaigns_again(
    env: Env,
) -> None:
    coordinator = env.start()
    assert coordinator.leading.wait(5)
    first = coordinator.election.fence
    assert first is not None
    # When etcd says the lease is gone / Then it steps down and stands again with a new one
    env.fake.expire(env.fake.lease_of(first.key))
    eventually("a new candidate", lambda: (coordinator.election.fence or first) != first)
    assert coordinator.leading.wait(5)
    # When etcd cannot be reached / Then it steps down
    second = coordinator.election.fence
    assert second is not None and second != first
    env.fake.go_down()
    eventually("stepped down", lambda: not coordinator.leading.is_set())
    # And once etcd is back it leads again, when its old candidate's lease has expired
    env.fake.come_up()
    eventually("a third candidate", lambda: len(env.group.snapshot().leaders) == 2)
    assert not coordinator.leading.wait(0.2)
    env.fake.expire(env.fake.lease_of(second.key))
    assert coordinator.leading.wait(5)
    env.join("a")
    eventually("an assignment", lambda: env.counts() == {"a": P})


def test_the_leader_deletes_forged_claims_at_once_and_unbound_ones_after_the_grace(
    env: Env,
) -> None:
    # Given a led, balanced stream whose members hold their claims
    env.start(unbound_grace=0.5)
    env.join("a", "b")
    eventually("balance", lambda: env.counts() == {"a": 4, "b": 4})
    env.claim_assigned()
    victim = min(p for p, owner in env.assignment().items() if owner == "b")
    removed = REGISTRY.get_sample_value(
        "partq_forged_removed_total", {"stream": env.stream, "kind": "claim"}
    )
    # When a claim in b's name is put on no lease
    env.fake.put(keys.claim(env.stream, victim), '{"v": 1, "member": "b", "at": 1}')
    # Then readers do not see it, and the leader deletes it
    assert victim not in env.group.snapshot().claims
    eventually("deleted", lambda: env.fake.get(keys.claim(env.stream, victim))[0] is None)
    # When one in b's name is put on a lease no member holds
    spare = env.fake.lease(30)
    began = time.monotonic()
    env.fake.put(keys.claim(env.stream, victim), '{"v": 1, "member": "b", "at": 1}', lease=spare)
    assert env.group.snapshot().claims[victim].member == "b"  # honoured, as a drain's
    eventually("deleted", lambda: env.fake.get(keys.claim(env.stream, victim))[0] is None)
    assert time.monotonic() - began >= 0.5

    def counted() -> float:  # each counted once deleted: the fake can show the delete first
        after = REGISTRY.get_sample_value(
            "partq_forged_removed_total", {"stream": env.stream, "kind": "claim"}
        )
        return (after or 0) - (removed or 0)

    eventually("both deletions counted", lambda: counted() == 2)


class _Denied(grpc.RpcError):  # type: ignore[misc]
    """What etcd answers to a role without the right to a key."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "etcdserver: permission denied"


def test_a_forged_claim_the_leader_may_not_delete_is_reported_once_not_retried_each_step(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a leader whose role may not delete claims, counted in its steps
    leader = env.start()
    assert leader.leading.wait(5)
    env.join("a")
    eventually("an assignment", lambda: env.counts() == {"a": P})
    steps: list[int] = []
    lead = leader._lead

    def counted(event: Any) -> None:
        steps.append(1)
        lead(event)

    leader._lead = counted  # type: ignore[method-assign]
    denied: list[str] = []
    transaction = env.fake.transaction

    def refusing(compare: list[Any], success: Any = None, failure: Any = None) -> Any:
        for op in success or []:
            if isinstance(op, etcd3.transactions.Delete) and b"/claims/" in to_bytes(op.key):
                denied.append(op.key)
                raise _Denied()
        return transaction(compare, success, failure)

    env.fake.transaction = refusing  # type: ignore[method-assign]
    # When a claim is forged (on no lease) and the leader takes several steps after
    env.fake.put(keys.claim(env.stream, 0), '{"v": 1, "member": "a", "at": 1}')
    eventually("a refused deletion", lambda: denied)
    for i in range(3):
        seen = len(steps)
        env.fake.put(keys.parked(env.stream, f"x{i}"), "{not json")  # wakes the leader
        eventually("another step", lambda seen=seen: len(steps) > seen)  # type: ignore[misc]
    # Then it tried once and said so once; the claim is still ignored by every reader
    assert len(denied) == 1
    warned = [r for r in caplog.records if "cannot delete the forged claim" in r.getMessage()]
    assert len(warned) == 1
    assert 0 not in env.group.snapshot().claims and leader.leading.is_set()


def test_a_watch_behind_a_compaction_resyncs_from_a_fresh_read_in_the_same_campaign(
    env: Env,
) -> None:
    # Given a leader
    leader = env.start()
    assert leader.leading.wait(5)
    fence = leader.election.fence
    # When its watch ends because etcd compacted the revisions it still had to deliver
    env.fake.end_watches(etcd3.exceptions.RevisionCompactedError(2))
    # ... and members join after
    env.join("a", "b")
    # Then it reads the group again and watches on, still leading on the same candidate key
    eventually("balance", lambda: env.counts() == {"a": 4, "b": 4})
    assert leader.election.fence == fence and leader.leading.is_set()


@pytest.mark.parametrize("on", ["no lease", "another lease"])
def test_a_leader_candidate_not_on_its_own_lease_never_leads_and_the_leader_deletes_it(
    env: Env, on: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43, item 5: a lease-less leader/ffffffffffffffff led for ever, and nothing said why."""
    # Given a candidate key put before any coordinator, with the lowest create revision,
    # on no lease, or on a lease its name does not give (a consumer's, say)
    forged = keys.leader_prefix(env.stream) + "ffffffffffffffff"
    env.fake.put(forged, "", lease=None if on == "no lease" else env.fake.lease(30))
    # When a coordinator campaigns
    with caplog.at_level(logging.WARNING):
        coordinator = env.start()
        # Then it leads, assigns, deletes the forged key and names it in one line
        assert coordinator.leading.wait(5)
        env.join("a")
        eventually("an assignment", lambda: env.counts() == {"a": P})
        eventually("deleted", lambda: env.fake.get(forged)[0] is None)
    named = [r.getMessage() for r in caplog.records if forged in r.getMessage()]
    deleted = [line for line in named if "deleted the leader candidate key" in line]
    assert len(deleted) == 1 and "\n" not in deleted[0], named
