"""A refusal from etcd is final for every retry loop; an outage is retried.

On a FakeEtcd whose calls fail as etcd would (``CallFailed`` with etcd's gRPC status):
a lease whose renewal is refused counts as lost, a watch that etcd ends with a refusal
reports the refusal, and a coordinator whose campaign is refused stops with it instead
of campaigning forever. (tests/integration/test_etcd_refusals.py: a consumer, on a real
etcd with auth.)
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from typing import Any

import etcd3.exceptions
import grpc
import pytest
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.errors import EtcdPermissionDenied, EtcdUnavailable
from partq.kernel.etcd import CallFailed, Identity
from tests.fakes.etcd import FakeEtcd
from tests.polling import eventually

WAIT = 10.0
USER = Identity(user="partq", ca="/etc/partq/ca.pem")


def _denied(op: str, key: str) -> CallFailed:
    return CallFailed(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", USER,
                      op=op, key=key)  # fmt: skip


@pytest.fixture
def fake() -> FakeEtcd:
    return FakeEtcd()


@pytest.fixture
def stream(fake: FakeEtcd) -> str:
    name = f"s-{uuid.uuid4().hex[:8]}"
    Registry(fake, "fake").create(StreamSpec(name, 4))
    return name


@pytest.fixture
def failures() -> list[int]:
    return []


@pytest.fixture
def session(fake: FakeEtcd, failures: list[int]) -> Iterator[Session]:
    """A session of 1 s renewing every 1/3 s; ``failures`` counts its failed renewals."""
    session = Session(fake, "fake", ttl=1, on_renewal_failure=lambda: failures.append(1))
    yield session
    session.close(revoke=False)


def test_a_refused_renewal_loses_the_lease_at_once(
    fake: FakeEtcd, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a session, when etcd refuses the user's token for good
    def refused(_lease: int) -> Any:
        raise CallFailed(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", USER)

    monkeypatch.setattr(fake, "refresh_lease", refused)
    # Then the session counts as lost (its owner stops, rejoins, and hears the refusal)
    assert session.lost.wait(WAIT), "a refused renewal must lose the lease"


def test_an_unreachable_etcd_does_not_lose_the_lease(
    fake: FakeEtcd, session: Session, failures: list[int]
) -> None:
    # Given a session, when etcd cannot be reached for several renewals
    fake.go_down()
    eventually("three failed renewals", lambda: len(failures) >= 3, timeout=WAIT)
    # Then they are counted, and the lease is not lost: nobody can take our partitions
    assert not session.lost.is_set()
    fake.come_up()


def test_a_watch_ended_by_a_refusal_reports_the_refusal(fake: FakeEtcd, stream: str) -> None:
    group = Group(fake, "fake", stream)
    heard: queue.Queue[Any] = queue.Queue()
    now = group.snapshot().revision
    # When etcd ends one watch refusing it, and another as if unreachable
    group.watch(now, heard.put)
    fake.end_watches(_denied("watch", keys.stream_prefix(stream) + "*"))
    refused = heard.get(timeout=WAIT)
    group.watch(now, heard.put)
    fake.end_watches(etcd3.exceptions.ConnectionFailedError())
    away = heard.get(timeout=WAIT)
    # Then the first says what to grant and is not retried; the second is
    assert isinstance(refused, EtcdPermissionDenied) and not refused.retryable
    assert "grant its role read on the prefix" in str(refused)
    assert isinstance(away, EtcdUnavailable) and away.retryable


def test_a_refused_campaign_stops_the_coordinator_with_the_refusal(
    fake: FakeEtcd, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a coordinator whose role may not read the stream's keys
    prefix = keys.stream_prefix(stream)

    def refused(key: str | bytes) -> Any:
        raise _denied("read", prefix + "*")

    monkeypatch.setattr(fake, "get_prefix_response", refused)
    coordinator = StreamCoordinator(
        Registry(fake, "fake"), stream, CoordinatorConfig(settle=0.05, ttl=1)
    )
    # When it campaigns
    coordinator.start()
    coordinator.join(WAIT)
    try:
        # Then it stops (partq coordinator exits 1) with the line that says what to grant
        assert not coordinator.is_alive(), "a refusal must not be retried forever"
        assert isinstance(coordinator.failure, EtcdPermissionDenied)
        assert f"grant its role read on the prefix {prefix}" in str(coordinator.failure)
    finally:
        coordinator.stop()
        coordinator.join(WAIT)
