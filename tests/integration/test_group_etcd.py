"""Sessions, membership, claims, watches and leader fencing against a real etcd."""

from __future__ import annotations

import dataclasses
import logging
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops.status import snapshot_status
from partq.coordinator.store.group import Group, WatchEvent
from partq.coordinator.store.session import Session
from partq.producer.contract import MAX_PARTITIONS, StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.errors import EtcdUnavailable, MemberIdTaken, NotLeader
from partq.kernel.etcd import connect
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.polling import wait_until

pytestmark = [pytest.mark.integration]


@pytest.fixture
def client(etcd_server: LocalEtcd) -> Iterator[Any]:
    c = connect(Settings.load(etcd_endpoints=etcd_server.endpoint))
    yield c
    c.close()


def test_a_second_live_member_with_the_same_id_is_refused(client: Any, stream_name: str) -> None:
    # Given a live member "m"
    group = Group(client, "test", stream_name)
    first = Session(client, "test", ttl=2)
    group.join(first, "m")
    second = Session(client, "test", ttl=2)
    try:
        # When another session joins as "m" / Then it is refused, naming what to do
        with pytest.raises(MemberIdTaken, match="another --member-id"):
            group.join(second, "m")
        assert group.snapshot().members["m"].lease == first.id
    finally:
        first.close()
        second.close()


def test_a_restarted_member_waits_out_its_crashed_predecessor(
    client: Any, stream_name: str
) -> None:
    # Given member "m" whose process died (its lease is no longer refreshed)
    group = Group(client, "test", stream_name)
    crashed = Session(client, "test", ttl=2)
    group.join(crashed, "m")
    crashed.close(revoke=False)
    restarted = Session(client, "test", ttl=2)
    try:
        # When it restarts with the same id
        began = time.monotonic()
        group.join(restarted, "m")
        # Then it joins once the old lease expired, within the TTL and its rounding
        assert time.monotonic() - began < 4.5
        assert group.snapshot().members["m"].lease == restarted.id
    finally:
        restarted.close()


def test_a_revoked_lease_is_reported_lost_and_its_keys_vanish(
    client: Any, stream_name: str
) -> None:
    # Given a member with a claim
    group = Group(client, "test", stream_name)
    lost = threading.Event()
    session = Session(client, "test", ttl=1, on_lost=lost.set)
    group.join(session, "m")
    assert group.claim(3, "m", session)
    # When etcd revokes its lease behind its back
    client.revoke_lease(session.id)
    # Then the session reports it within a refresh interval and the keys are gone
    assert lost.wait(3)
    state = group.snapshot()
    assert "m" not in state.members
    assert 3 not in state.claims
    session.close()


def test_claims_are_exclusive_and_only_the_holder_releases(client: Any, stream_name: str) -> None:
    group = Group(client, "test", stream_name)
    a, b = Session(client, "test", ttl=2), Session(client, "test", ttl=2)
    try:
        assert group.claim(0, "a", a)
        assert group.claim(0, "a", a)  # idempotent for the holder
        assert not group.claim(0, "b", b)
        group.release(0, b)  # not b's: a no-op
        assert group.snapshot().claims[0].member == "a"
        group.release(0, a)
        assert group.claim(0, "b", b)
    finally:
        a.close()
        b.close()


def test_a_claim_is_handed_over_only_by_its_holder_to_a_live_member(
    client: Any, stream_name: str
) -> None:
    group = Group(client, "test", stream_name)
    a, b, c = (Session(client, "test", ttl=2) for _ in range(3))
    try:
        group.join(b, "b")
        heir = group.snapshot().members["b"]
        assert group.claim(0, "a", a)
        # Only the holder hands over: c's attempt changes nothing
        assert group.hand_over(0, c, heir) == 0
        assert group.snapshot().claims[0].member == "a"
        # The holder's does, in one step: b's claim, on b's lease
        revision = group.hand_over(0, a, heir)
        assert revision > 0
        claim = group.snapshot().claims[0]
        assert (claim.member, claim.lease) == ("b", b.id)
        assert group.claim(0, "b", b) == revision  # b finds it its own
        # A member gone or restarted (another lease) is not handed anything
        assert group.claim(1, "a", a)
        stale = dataclasses.replace(heir, lease=c.id)
        assert group.hand_over(1, a, stale) == 0
        group.leave("b", b)
        assert group.hand_over(1, a, heir) == 0
        assert group.snapshot().claims[1].member == "a"
    finally:
        for session in (a, b, c):
            session.close()


def test_a_watch_reports_when_etcd_goes_away() -> None:
    # Given a watch on a private etcd (python3-etcd3's watcher needs partq's patch for this)
    with tempfile.TemporaryDirectory() as data:
        etcd = LocalEtcd(data_dir=Path(data)).start()
        try:
            c = connect(Settings.load(etcd_endpoints=etcd.endpoint))
            group = Group(c, etcd.endpoint, "w")
            events: queue.Queue[WatchEvent | Exception] = queue.Queue()
            group.watch(group.snapshot().revision, events.put)
            c.put(keys.claim("w", 1), '{"v": 1, "member": "x"}')
            assert isinstance(events.get(timeout=5), WatchEvent)
            # When etcd restarts
            etcd.restart()
            # Then the callback hears that the watch ended, so the caller can resync
            assert isinstance(events.get(timeout=10), EtcdUnavailable)
            c.close()
        finally:
            etcd.stop()


def test_a_deposed_leader_cannot_write_the_assignment(
    settings: Settings, registry: Registry, stream_name: str
) -> None:
    # Given a leading coordinator
    registry.create(StreamSpec(stream_name, 4))
    leader = StreamCoordinator(registry, stream_name, CoordinatorConfig(settle=0.1, ttl=2))
    leader.start()
    try:
        assert leader.leading.wait(10)
        fence = leader.election.fence
        assert fence is not None
        # When its candidate key disappears (its lease expired while it was away)
        registry.client.delete(fence.key)
        # Then its next fenced write is refused
        with pytest.raises(NotLeader):
            leader._write({0: "someone"}, "test")
        assert 0 not in Group(registry.client, "test", stream_name).snapshot().assignment
    finally:
        leader.stop()
        leader.join(10)
        registry.delete(stream_name)


@pytest.mark.slow
def test_the_whole_partition_range_is_read_back_by_status_and_delete(
    registry: Registry, rabbitmq: str, stream_name: str
) -> None:
    # Given a stream at the top of the partition range, every partition assigned to a live
    # member and with a hot standby, as a leader writes them (long member ids: a large answer)
    registry.create(StreamSpec(stream_name, MAX_PARTITIONS))
    group = Group(registry.client, "test", stream_name)
    session = Session(registry.client, "test", ttl=30)
    owner = "m" * 200
    try:
        group.join(session, owner)
        fence = group.stand(session)
        assert len(group.assign(fence, dict.fromkeys(range(MAX_PARTITIONS), owner))) == (
            MAX_PARTITIONS
        )
        changes = [(p, "s" * 200) for p in range(MAX_PARTITIONS)]
        assert len(group.name_standbys(fence, changes)) == MAX_PARTITIONS
        # When `partq status` reads it (its etcd part: depths from RabbitMQ left out)
        report = snapshot_status(registry, rabbitmq, stream_name, depths=lambda _spec: [])
        # Then every partition is there, with its owner
        assert report["partitions"] == MAX_PARTITIONS
        assert report["assignment"] == {str(p): owner for p in range(MAX_PARTITIONS)}
        # And `partq stream delete` reads its parked keys and deletes every key
        assert group.parked() == {}
    finally:
        session.close()
        registry.delete(stream_name)
    assert list(registry.client.get_prefix(keys.stream_prefix(stream_name))) == []


def test_a_changed_spec_is_logged_once_per_stream_in_words(
    registry: Registry, stream_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a leading coordinator of a 4-partition stream
    registry.create(StreamSpec(stream_name, 4))
    leader = StreamCoordinator(registry, stream_name, CoordinatorConfig(settle=0.1, ttl=2))
    caplog.set_level(logging.INFO, logger="partq")
    leader.start()
    try:
        assert leader.leading.wait(10)
        # When its spec changes (a resize's switch: 6 partitions in epoch 1)
        changed = StreamSpec(stream_name, 6, version=2, epoch=1)
        registry.client.put(keys.spec(stream_name), changed.to_json())

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if "spec changed" in r.getMessage()]

        wait_until(lines, 10, 0.05, "the change logged")
        # Then one line names the stream once and says what changed, in words
        line = lines()[0]
        assert line.startswith(f"{stream_name}: its spec changed: partitions 4 -> 6")
        assert "epoch 0 -> 1" in line
        assert f"{stream_name}: {stream_name}" not in line and "StreamSpec(" not in line
    finally:
        leader.stop()
        leader.join(10)
        registry.delete(stream_name)
