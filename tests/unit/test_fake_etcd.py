"""tests.fakes.etcd.FakeEtcd answers as etcd does, on the client surface partq uses.

The tests take a ``client`` and a key ``prefix``; here the client is a FakeEtcd.
tests/integration/test_etcd_contract.py imports them and runs them against a real etcd,
which is what makes the fake trustworthy. Tests only the fake can run (expiring a lease
now, etcd going down) are at the end.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Any

import etcd3.exceptions
import pytest

from partq.kernel.errors import EtcdCompacted, EtcdUnavailable
from partq.kernel.etcd import etcd_errors, lease_is
from tests.fakes.etcd import FakeEtcd


@pytest.fixture
def client() -> Any:
    return FakeEtcd()


@pytest.fixture
def prefix() -> str:
    return f"/partq-contract/{uuid.uuid4().hex[:8]}/"


class Watched:
    """A prefix watch's responses, as (type, key suffix, value) per event, one list per response."""

    def __init__(self, client: Any, prefix: str, start_revision: int | None = None) -> None:
        self.prefix = prefix
        self.responses: queue.Queue[Any] = queue.Queue()
        kwargs = {} if start_revision is None else {"start_revision": start_revision}
        self.id = client.add_watch_prefix_callback(prefix, self.responses.put, **kwargs)

    def next(self, count: int = 1, timeout: float = 5.0) -> list[tuple[str, str, bytes, int]]:
        """The next ``count`` events as (type, key after the prefix, value, mod revision).

        etcd may put several revisions' events in one response (a watch catching up on
        history does), never one revision's in two: so events, not responses, are counted.
        """
        events: list[tuple[str, str, bytes, int]] = []
        while len(events) < count:
            response = self.responses.get(timeout=timeout)
            assert not isinstance(response, Exception) and response is not None, response
            events += [
                (type(e).__name__, e.key.decode()[len(self.prefix) :], e.value, e.mod_revision)
                for e in response.events
            ]
        assert len(events) == count, events
        return events

    def quiet(self, seconds: float = 0.3) -> bool:
        try:
            self.responses.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


def test_put_get_delete_and_revisions(client: Any, prefix: str) -> None:
    # Given a key put twice
    first = client.put(prefix + "a", "1").header.revision
    second = client.put(prefix + "a", b"2").header.revision
    # Then each write is one revision, and the metadata counts them
    assert second == first + 1
    value, meta = client.get(prefix + "a")
    assert value == b"2"
    assert (meta.create_revision, meta.mod_revision, meta.version, meta.lease_id) == (
        first,
        second,
        2,
        0,
    )
    assert meta.key == (prefix + "a").encode()
    # And a delete removes it; deleting nothing is no write
    assert client.delete(prefix + "a") is True
    assert client.get(prefix + "a") == (None, None)
    assert client.delete(prefix + "a") is False
    assert client.get_prefix_response(prefix).header.revision == second + 1


def test_a_read_at_a_revision_sees_the_key_as_it_was_then_until_compacted(
    client: Any, prefix: str
) -> None:
    # Given a key put, put again, then deleted
    key = prefix + "then"
    first = client.put(key, "1", lease=None).header.revision
    second = client.put(key, "2").header.revision
    client.delete(key)
    # Then a read at a revision sees it as it was then, and now it is gone
    assert client.get(key, revision=first)[0] == b"1"
    value, meta = client.get(key, revision=second)
    assert (value, meta.mod_revision, meta.create_revision) == (b"2", second, first)
    assert client.get(key, revision=second + 1) == (None, None)
    assert client.get(key) == (None, None)
    # When etcd compacts its history up to now / Then the past is gone: EtcdCompacted
    now = client.get_prefix_response(prefix).header.revision
    client.compact(now)
    with pytest.raises(EtcdCompacted, match="compacted"), etcd_errors("here"):
        client.get(key, revision=second)
    assert client.get(key, revision=now) == (None, None)  # the compaction's own is kept
    # And a watch from before it ends at once, saying so
    ended: queue.Queue[Any] = queue.Queue()
    client.add_watch_prefix_callback(prefix, ended.put, start_revision=first)
    assert isinstance(ended.get(timeout=5), etcd3.exceptions.RevisionCompactedError)


def test_prefix_reads_are_sorted_and_bounded(client: Any, prefix: str) -> None:
    for key in ("b", "a/2", "a/1"):
        client.put(prefix + key, key)
    client.put(prefix[:-1] + "x", "outside")  # shares the prefix without its slash
    try:
        assert [(m.key.decode()[len(prefix) :], v) for v, m in client.get_prefix(prefix)] == [
            ("a/1", b"a/1"),
            ("a/2", b"a/2"),
            ("b", b"b"),
        ]
        response = client.get_prefix_response(prefix + "a/")
        assert [kv.key.decode()[len(prefix) :] for kv in response.kvs] == ["a/1", "a/2"]
        assert response.kvs[0].create_revision > response.kvs[1].create_revision  # a/2 came first
        client.delete_prefix(prefix + "a/")
        assert [v for v, _ in client.get_prefix(prefix)] == [b"b"]
    finally:
        client.delete(prefix[:-1] + "x")


def test_create_if_absent_transaction(client: Any, prefix: str) -> None:
    t, key = client.transactions, prefix + "k"

    def create(value: str) -> tuple[bool, list[Any]]:
        ok, responses = client.transaction(
            compare=[t.version(key) == 0], success=[t.put(key, value)], failure=[t.get(key)]
        )
        return bool(ok), responses

    ok, responses = create("first")
    assert ok
    revision = responses[0].response_put.header.revision
    assert client.get(key)[1].mod_revision == revision
    ok, responses = create("second")
    assert not ok
    [(value, meta)] = responses[0]
    assert (value, meta.mod_revision, meta.create_revision) == (b"first", revision, revision)


def test_comparisons_on_create_mod_value_and_lease(client: Any, prefix: str) -> None:
    t, key = client.transactions, prefix + "k"
    lease = client.lease(10)
    try:
        created = client.put(key, "v", lease=lease).header.revision
        client.put(prefix + "other", "x")  # moves the store's revision on

        def holds(*compare: Any) -> bool:
            return bool(client.transaction(compare=list(compare), success=[], failure=[])[0])

        assert holds(t.create(key) == created, t.mod(key) == created, t.value(key) == "v")
        assert holds(t.version(key) == 1, t.version(key) > 0, t.create(key) < created + 1)
        assert holds(lease_is(key, lease.id))
        assert not holds(t.create(key) == created + 1)
        assert not holds(t.value(key) == "w")
        assert not holds(t.create(key) != created)
        assert not holds(lease_is(key, lease.id + 1))
        assert not holds(t.create(key) == created, t.version(key) == 0)  # all must hold
        # A deleted key compares as absent: version 0, create revision 0
        client.delete(key)
        assert holds(t.version(key) == 0, t.create(key) == 0)
        # And a transaction's delete answers with its revision
        client.put(key, "again")
        ok, responses = client.transaction(
            compare=[t.value(key) == "again"], success=[t.delete(key)], failure=[]
        )
        assert ok and responses[0].response_delete_range.deleted == 1
        assert (
            responses[0].response_delete_range.header.revision
            == client.get_prefix_response(prefix).header.revision
        )
    finally:
        client.revoke_lease(lease.id)


def test_lease_keys_go_with_the_lease(client: Any, prefix: str) -> None:
    lease = client.lease(10)
    client.put(prefix + "on-lease", "x", lease=lease)
    client.put(prefix + "on-id", "y", lease=lease.id)
    client.put(prefix + "free", "z")
    assert client.get(prefix + "on-lease")[1].lease_id == lease.id
    assert next(r.TTL for r in client.refresh_lease(lease.id)) > 0
    assert 0 < client.get_lease_info(lease.id).TTL <= 10
    watched = Watched(client, prefix)
    # When the lease is revoked / Then its keys are deleted in one revision, the others stay
    client.revoke_lease(lease.id)
    assert sorted(e[:2] for e in watched.next(2)) == [
        ("DeleteEvent", "on-id"),
        ("DeleteEvent", "on-lease"),
    ]
    assert [v for v, _ in client.get_prefix(prefix)] == [b"z"]
    # And the lease is gone: refresh says TTL 0, its info TTL -1, a put on it fails
    assert next(r.TTL for r in client.refresh_lease(lease.id)) <= 0
    assert client.get_lease_info(lease.id).TTL == -1
    with pytest.raises(EtcdUnavailable, match="lease not found"), etcd_errors("here"):
        client.put(prefix + "late", "x", lease=lease)
    with pytest.raises(EtcdUnavailable, match="lease not found"), etcd_errors("here"):
        client.transaction(
            compare=[],
            success=[client.transactions.put(prefix + "late", "x", lease=lease)],
            failure=[],
        )
    assert client.get(prefix + "late") == (None, None)
    client.cancel_watch(watched.id)


def test_a_prefix_watch_gets_every_change_in_order(client: Any, prefix: str) -> None:
    watched = Watched(client, prefix)
    t = client.transactions
    a = client.put(prefix + "a", "1").header.revision
    _ok, _ = client.transaction(
        compare=[], success=[t.put(prefix + "b", "2"), t.put(prefix + "c", "3")], failure=[]
    )
    client.delete(prefix + "a")
    client.put(prefix[:-1] + "-elsewhere", "not watched")
    try:
        assert watched.next(4) == [
            ("PutEvent", "a", b"1", a),
            ("PutEvent", "b", b"2", a + 1),
            ("PutEvent", "c", b"3", a + 1),
            ("DeleteEvent", "a", b"", a + 2),
        ]
        assert watched.quiet()
        # A cancelled watch hears nothing more
        client.cancel_watch(watched.id)
        client.put(prefix + "d", "4")
        assert watched.quiet()
    finally:
        client.delete(prefix[:-1] + "-elsewhere")


def test_a_watch_from_a_revision_replays_what_came_after_it(client: Any, prefix: str) -> None:
    first = client.put(prefix + "a", "1").header.revision
    client.put(prefix + "b", "2")
    watched = Watched(client, prefix, start_revision=first + 1)
    client.put(prefix + "c", "3")
    assert [e[:2] for e in watched.next(2)] == [("PutEvent", "b"), ("PutEvent", "c")]
    client.cancel_watch(watched.id)


def test_watch_events_carry_the_lease(client: Any, prefix: str) -> None:
    lease = client.lease(10)
    watched = Watched(client, prefix)
    client.put(prefix + "a", "1", lease=lease)
    response = watched.responses.get(timeout=5)
    assert response.events[0].lease == lease.id
    client.cancel_watch(watched.id)
    client.revoke_lease(lease.id)


def test_watch_once_returns_the_next_event_or_times_out(client: Any, prefix: str) -> None:
    with pytest.raises(etcd3.exceptions.WatchTimedOut):
        client.watch_once(prefix + "k", timeout=0.2)
    timer = threading.Timer(0.2, lambda: client.put(prefix + "k", "v"))
    timer.start()
    event = client.watch_once(prefix + "k", timeout=5)
    timer.join()
    assert (type(event).__name__, event.value) == ("PutEvent", b"v")


# -- only the fake can do these ------------------------------------------------------------------


def test_expiring_a_lease_deletes_its_keys_and_ends_its_refreshes() -> None:
    fake = FakeEtcd()
    lease = fake.lease(5)
    fake.put("/a", "1", lease=lease)
    watched = Watched(fake, "/")
    fake.expire(lease.id)
    assert [e[:2] for e in watched.next()] == [("DeleteEvent", "a")]
    assert [r.TTL for r in fake.refresh_lease(lease.id)] == [0]
    assert fake.leases() == [] and list(fake.get_prefix("/")) == []


def test_an_etcd_that_is_down_fails_every_call_and_ends_watches() -> None:
    fake = FakeEtcd()
    ended: queue.Queue[Any] = queue.Queue()
    fake.add_watch_prefix_callback("/", ended.put)
    fake.go_down()
    assert isinstance(ended.get(timeout=1), etcd3.exceptions.ConnectionFailedError)
    with pytest.raises(EtcdUnavailable), etcd_errors("fake"):
        fake.put("/a", "1")
    with pytest.raises(EtcdUnavailable), etcd_errors("fake"):
        list(fake.refresh_lease(1))
    fake.come_up()
    fake.put("/a", "1")
    time.sleep(0.05)
    assert ended.empty()  # an ended watch hears nothing more


def test_a_callback_that_writes_does_not_deadlock_and_order_holds() -> None:
    fake = FakeEtcd()
    seen: list[str] = []

    def echo(response: Any) -> None:
        for event in response.events:
            key = event.key.decode()
            seen.append(key)
            if key == "/a":
                fake.put("/b", "from the callback")

    fake.add_watch_prefix_callback("/", echo)
    writers = [threading.Thread(target=fake.put, args=(f"/w{i}", "x")) for i in range(20)]
    fake.put("/a", "1")
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    deadline = time.monotonic() + 2
    while len(seen) < 22 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen[:2] == ["/a", "/b"] and len(seen) == 22
    revisions = [fake.get(k)[1].mod_revision for k in seen]
    assert revisions == sorted(revisions)
