"""The coordinator on real etcd: min members, settle, max moves, manual mode, operator CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops.admin import create_stream, delete
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel.settings import Settings
from tests.members import claim_assigned
from tests.polling import eventually

pytestmark = [pytest.mark.integration]
P = 8


class Members:
    """Members and their claims, played by sessions (no consumer processes needed)."""

    def __init__(self, registry: Registry, stream: str) -> None:
        self.registry = registry
        self.group = Group(registry.client, registry.where, stream)
        self.sessions: dict[str, Session] = {}

    def join(self, member: str) -> None:
        session = Session(self.registry.client, self.registry.where, ttl=5)
        self.sessions[member] = session
        self.group.join(session, member)

    def leave(self, member: str) -> None:
        self.sessions.pop(member).close(revoke=True)

    def claim_assigned(self) -> None:
        claim_assigned(self.group, self.sessions)

    def balanced_pair(self) -> None:
        """Members a and b join, are given 4 partitions each, and claim them."""
        self.join("a")
        self.join("b")
        eventually("balance", lambda: counts(self.assignment()) == {"a": 4, "b": 4})
        self.claim_assigned()

    def assignment(self) -> dict[int, str]:
        return self.group.snapshot().assignment

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()


@pytest.fixture
def stream(registry: Registry, stream_name: str) -> Iterator[str]:
    registry.create(StreamSpec(stream_name, P))
    yield stream_name
    registry.delete(stream_name)


@pytest.fixture
def members(registry: Registry, stream: str) -> Iterator[Members]:
    m = Members(registry, stream)
    yield m
    m.close()


@pytest.fixture
def run_coordinator(registry: Registry, stream: str) -> Iterator[Callable[..., StreamCoordinator]]:
    started: list[StreamCoordinator] = []

    def start(**config: Any) -> StreamCoordinator:
        coordinator = StreamCoordinator(registry, stream, CoordinatorConfig(ttl=2, **config))
        coordinator.start()
        started.append(coordinator)
        assert coordinator.leading.wait(10)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop()
        coordinator.join(10)


def counts(assignment: dict[int, str]) -> dict[str, int]:
    result: dict[str, int] = {}
    for owner in assignment.values():
        result[owner] = result.get(owner, 0) + 1
    return result


def test_waits_for_min_members_then_balances(
    members: Members, run_coordinator: Callable[..., StreamCoordinator]
) -> None:
    # Given a coordinator that needs two members
    run_coordinator(min_members=2, settle=0.2)
    members.join("a")
    time.sleep(0.6)  # longer than the settle window: it must still hold back
    assert members.assignment() == {}
    # When the second member joins / Then it assigns all partitions, balanced
    members.join("b")
    eventually("a balanced assignment", lambda: counts(members.assignment()) == {"a": 4, "b": 4})


def test_max_moves_limits_partitions_in_motion(
    members: Members, run_coordinator: Callable[..., StreamCoordinator]
) -> None:
    # Given member a owning and consuming all 8 partitions
    run_coordinator(settle=0.1, max_moves=2)
    members.join("a")
    eventually("a owns all", lambda: counts(members.assignment()) == {"a": P})
    members.claim_assigned()
    # When b joins (4 partitions should move)
    members.join("b")
    eventually("the first step", lambda: counts(members.assignment()).get("b") == 2)
    time.sleep(0.5)
    # Then only 2 are in motion until b has claimed them
    assert counts(members.assignment()) == {"a": 6, "b": 2}
    members.claim_assigned()
    eventually("the second step", lambda: counts(members.assignment()) == {"a": 4, "b": 4})


def partq(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PARTQ_ETCD_ENDPOINTS": settings.etcd_endpoints,
        "PARTQ_AMQP_URL": settings.amqp.url,
    }
    return subprocess.run(
        [sys.executable, "-m", "partq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_manual_mode_moves_only_on_operator_request(
    settings: Settings,
    members: Members,
    stream: str,
    run_coordinator: Callable[..., StreamCoordinator],
) -> None:
    # Given a manual-mode coordinator and two members
    run_coordinator(settle=0.1, manual=True)
    members.join("a")
    members.join("b")
    time.sleep(0.5)
    assert members.assignment() == {}
    # When the operator asks for a dry run / Then it prints the plan and changes nothing
    dry = partq(settings, "rebalance", stream, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "8 partitions would change owner" in dry.stdout
    time.sleep(0.3)
    assert members.assignment() == {}
    # When the operator rebalances / Then the leader assigns
    done = partq(settings, "rebalance", stream)
    assert done.returncode == 0, done.stderr
    eventually("the manual rebalance", lambda: counts(members.assignment()) == {"a": 4, "b": 4})
    members.claim_assigned()
    # When the operator moves one of a's partitions to b
    partition = min(p for p, o in members.assignment().items() if o == "a")
    moved = partq(settings, "move", stream, "--partition", str(partition), "--to", "b")
    assert moved.returncode == 0, moved.stderr
    eventually("the move", lambda: members.assignment()[partition] == "b")
    # When the operator drains a / Then all of a's partitions go to b
    drained = partq(settings, "drain", stream, "a")
    assert drained.returncode == 0, drained.stderr
    eventually("the drain", lambda: counts(members.assignment()) == {"b": P})
    # And bad requests are usage errors that say what to do
    unknown = partq(settings, "move", stream, "--partition", "0", "--to", "nobody")
    assert unknown.returncode == 2
    assert "not a live member" in unknown.stderr
    outside = partq(settings, "move", stream, "--partition", str(P), "--to", "b")
    assert outside.returncode == 2


def test_status_shows_leader_members_assignment_and_claims(
    settings: Settings,
    members: Members,
    stream: str,
    run_coordinator: Callable[..., StreamCoordinator],
    registry: Registry,
    rabbitmq: str,
) -> None:
    # Given a led stream with two members that claimed their partitions
    create_stream(registry, rabbitmq, StreamSpec(stream, P))
    run_coordinator(settle=0.1)
    members.balanced_pair()
    # When an operator asks for the status
    result = partq(settings, "status", stream, "--json")
    # Then it reports all of it
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["leader"]
    assert sorted(m["id"] for m in report["members"]) == ["a", "b"]
    assert sorted(report["assignment"].values()) == ["a"] * 4 + ["b"] * 4
    assert report["claims"] == report["assignment"]
    assert report["unassigned"] == []
    assert report["in_motion"] == []
    assert [row["messages"] for row in report["rows"]] == [0] * P
    text = partq(settings, "status", stream)
    assert text.returncode == 0
    assert "moves in progress: -" in text.stdout
    delete(registry, rabbitmq, stream)


def test_draining_every_member_is_refused_then_forced_then_cancelled(
    settings: Settings,
    members: Members,
    stream: str,
    run_coordinator: Callable[..., StreamCoordinator],
) -> None:
    # Given two members consuming a balanced stream
    run_coordinator(settle=0.1)
    members.balanced_pair()
    # When a is drained / Then b owns everything
    drained = partq(settings, "drain", stream, "a")
    assert drained.returncode == 0, drained.stderr
    assert f"undo: partq drain {stream} a --cancel" in drained.stdout
    eventually("the drain of a", lambda: counts(members.assignment()) == {"b": P})
    members.claim_assigned()
    # When b, the last member not drained, is drained too / Then it is refused in one line
    refused = partq(settings, "drain", stream, "b")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("partq: error: b is the last member of")
    assert refused.stderr.count("\n") == 1 and "--force" in refused.stderr
    # When it is forced / Then status marks both members drained
    forced = partq(settings, "drain", stream, "b", "--force")
    assert forced.returncode == 0, forced.stderr
    report = json.loads(partq(settings, "status", stream, "--json").stdout)
    assert {m["id"]: m["draining"] for m in report["members"]} == {"a": True, "b": True}
    text = partq(settings, "status", stream).stdout
    assert "DRAINED" in text and "drained (given no partitions; undo:" in text
    # When both drains are cancelled
    for member in ("a", "b"):
        cancelled = partq(settings, "drain", stream, member, "--cancel")
        assert cancelled.returncode == 0, cancelled.stderr
        assert (
            cancelled.stdout
            == f"drain of {member} cancelled: the leader gives it partitions again\n"
        )
    # Then every partition is assigned again, balanced over both
    eventually("all assigned again", lambda: counts(members.assignment()) == {"a": 4, "b": 4})
    report = json.loads(partq(settings, "status", stream, "--json").stdout)
    assert report["unassigned"] == [] and not any(m["draining"] for m in report["members"])
    # And cancelling again says there is nothing to cancel
    again = partq(settings, "drain", stream, "a", "--cancel")
    assert (again.returncode, again.stdout) == (
        0,
        f"a is not drained in {stream}: nothing to cancel\n",
    )


def test_requests_warn_without_a_coordinator_and_when_policies_differ(
    settings: Settings,
    registry: Registry,
    members: Members,
    stream: str,
    run_coordinator: Callable[..., StreamCoordinator],
) -> None:
    # Given a stream with a member and no coordinator
    members.join("a")
    # When an operator asks for a rebalance or a pause / Then each warns, and is stored
    for args in (("rebalance", stream), ("pause", stream)):
        result = partq(settings, *args)
        assert result.returncode == 0, result.stderr
        assert result.stderr.startswith(f"partq: warning: no coordinator leads {stream}: ")
    partq(settings, "resume", stream)
    # Given two coordinators with different policies
    run_coordinator(settle=0.1)
    other = StreamCoordinator(registry, stream, CoordinatorConfig(ttl=2, balance="load"))
    other.start()
    try:
        group = Group(registry.client, registry.where, stream)
        eventually("both policies announced", lambda: len(group.policies()) == 2)
        # When a rebalance is asked for / Then it warns naming the setting that differs
        result = partq(settings, "rebalance", stream)
        assert result.returncode == 0, result.stderr
        assert "run with different policies (balance: " in result.stderr
        assert '"count" (1), "load" (1)' in result.stderr
    finally:
        other.stop()
        other.join(10)
    # And with the second one gone, no warning
    eventually("one policy left", lambda: len(group.policies()) == 1, timeout=15)
    quiet = partq(settings, "rebalance", stream)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
