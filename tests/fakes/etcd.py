"""An in-memory etcd for unit tests: the python3-etcd3 client surface partq uses, no server.

:class:`FakeEtcd` stands where ``etcd3.MultiEndpointEtcd3Client`` does (``Registry(FakeEtcd(),
"fake")``) and answers with the client's own types (``etcdrpc`` responses, ``KVMetadata``,
``Lease``, ``PutEvent``/``DeleteEvent`` in a ``WatchResponse``):

- ``put``/``get`` (``revision``: the key as it was then)/``get_prefix``/
  ``get_prefix_response``/``delete``/``delete_prefix``; ``compact`` (a read of a revision
  before it then fails as etcd's does, and a watch from one ends at once with
  ``RevisionCompactedError``);
- ``transaction`` with comparisons on value, version, create and mod revision and lease
  (``partq.kernel.etcd.lease_is``), and put/get/delete operations: one revision per write;
- leases: ``lease``, ``refresh_lease`` (TTL 0 once gone), ``revoke_lease``,
  ``get_lease_info``; a put on a lease that is gone fails as etcd's does. Leases never
  expire by themselves: :meth:`FakeEtcd.expire` expires one (its keys are deleted);
- watches: ``add_watch_prefix_callback``/``add_watch_callback`` (``start_revision`` replays
  history), ``watch_once``, ``cancel_watch``; responses in revision order, one per
  revision, delivered by a writing thread after its write;
- failures: :meth:`FakeEtcd.go_down` (every call raises ``ConnectionFailedError``, watches
  end with it, as when etcd cannot be reached) and :meth:`FakeEtcd.come_up`;
  :meth:`FakeEtcd.end_watches` ends every watch with an error.

It implements :class:`partq.kernel.etcd.EtcdClient` (mypy checks it, at the end of this module).
tests/unit/test_fake_etcd.py pins this behaviour; tests/integration/test_etcd_contract.py
runs the same tests against a real etcd.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import etcd3.exceptions
import grpc
from etcd3 import etcdrpc
from etcd3.client import KVMetadata, Status, Transactions
from etcd3.etcdrpc.kv_pb2 import Event, KeyValue
from etcd3.events import new_event
from etcd3.leases import Lease
from etcd3.utils import lease_to_id, prefix_range_end, to_bytes
from etcd3.watch import WatchResponse

from partq.kernel.etcd import EtcdClient

__all__ = ["Compacted", "FakeEtcd", "LeaseNotFound"]

log = logging.getLogger("partq.testing.etcd")
_PUT, _DELETE = Event.PUT, Event.DELETE
_C = etcdrpc.Compare
_RESULTS = {
    _C.EQUAL: operator.eq,
    _C.NOT_EQUAL: operator.ne,
    _C.LESS: operator.lt,
    _C.GREATER: operator.gt,
}
# a comparison's target -> the field it compares (named alike in KeyValue and Compare)
_TARGETS = {
    _C.VALUE: "value",
    _C.VERSION: "version",
    _C.CREATE: "create_revision",
    _C.MOD: "mod_revision",
    _C.LEASE: "lease",
}


class LeaseNotFound(grpc.RpcError):  # type: ignore[misc]
    """What etcd answers to a put on, or a revoke of, a lease that does not exist."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "etcdserver: requested lease not found"


class Compacted(grpc.RpcError):  # type: ignore[misc]
    """What etcd answers to a read of a revision it has compacted away."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OUT_OF_RANGE

    def details(self) -> str:
        return "etcdserver: mvcc: required revision has been compacted"


@dataclass
class _Lease:
    ttl: int
    keys: set[bytes] = field(default_factory=set)


def _covers(start: bytes, end: bytes | None, key: bytes) -> bool:
    """Whether ``key`` is in etcd's range [start, end) (``end`` None: ``start`` alone)."""
    if end is None:
        return key == start
    return start <= key and (end == b"\0" or key < end)


@dataclass
class _Watch:
    start: bytes
    end: bytes | None
    callback: Callable[[Any], None]
    backlog: collections.deque[Any] = field(default_factory=collections.deque)
    ended: bool = False  # its last response (an error) is in the backlog
    cancelled: bool = False


class FakeEtcd:
    """One in-memory etcd and a client of it (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self.transactions = Transactions()
        self._lock = threading.Lock()
        self._dispatching = threading.Lock()
        self._kvs: dict[bytes, KeyValue] = {}
        self._revision = 1  # an empty etcd is at revision 1
        self._compacted = 0  # revisions before it are gone (compact)
        self._history: list[tuple[int, list[Event]]] = []
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 0x7A3B00000000
        self._watches: dict[int, _Watch] = {}
        self._next_watch = 0
        self._down = False

    # -- what a test drives ------------------------------------------------------------

    def expire(self, lease_id: int) -> None:
        """Expire a lease now, as etcd does after its TTL: its keys are deleted."""
        with self._lock:
            self._drop_lease(lease_id)
        self._dispatch()

    def leases(self) -> list[int]:
        with self._lock:
            return sorted(self._leases)

    def lease_of(self, key: str) -> int:
        """The lease ``key`` is attached to (0: none or no such key)."""
        with self._lock:
            kv = self._kvs.get(to_bytes(key))
            return kv.lease if kv is not None else 0

    def go_down(self) -> None:
        """From now on every call fails as with an unreachable etcd; watches end."""
        self._down = True
        self.end_watches(etcd3.exceptions.ConnectionFailedError())

    def come_up(self) -> None:
        self._down = False

    def end_watches(self, error: Exception | None = None) -> None:
        """End every watch: its callback gets ``error`` (an etcd3 watcher passes the error,
        or None), then nothing more."""
        with self._lock:
            for watch in self._watches.values():
                if not watch.ended:
                    watch.ended = True
                    watch.backlog.append(error)
        self._dispatch()

    # -- the client surface ------------------------------------------------------------

    def _check(self) -> None:
        if self._down:
            raise etcd3.exceptions.ConnectionFailedError()

    def status(self) -> Any:
        self._check()
        return Status("fake", 0, None, self._revision, 1)

    def close(self) -> None:
        pass

    def get(
        self, key: str | bytes, revision: int | None = None
    ) -> tuple[bytes | None, KVMetadata | None]:
        if revision is None:
            response = self._range(to_bytes(key), None)
        else:
            response = self._range_at(to_bytes(key), revision)
        if not response.kvs:
            return None, None
        kv = response.kvs[0]
        return kv.value, KVMetadata(kv, response.header)

    def compact(self, revision: int, physical: bool = False) -> None:
        """Forget the history before ``revision``, as etcd's compaction does."""
        self._check()
        with self._lock:
            self._compacted = max(self._compacted, revision)  # the history is kept: reads
            # at a later revision replay it from the start

    def get_prefix_response(self, prefix: str | bytes) -> etcdrpc.RangeResponse:
        start = to_bytes(prefix)
        return self._range(start, prefix_range_end(start))

    def get_prefix(
        self, prefix: str | bytes, *, keys_only: bool = False
    ) -> Iterator[tuple[bytes, KVMetadata]]:
        response = self.get_prefix_response(prefix)
        return (
            (b"" if keys_only else kv.value, KVMetadata(kv, response.header)) for kv in response.kvs
        )

    def put(self, key: str | bytes, value: str | bytes, lease: Any = None) -> Any:
        ops = [self.transactions.put(key, value, lease)]
        return self.transaction([], ops, [])[1][0].response_put

    def delete(self, key: str | bytes) -> bool:
        ops = [self.transactions.delete(key)]
        return bool(self.transaction([], ops, [])[1][0].response_delete_range.deleted)

    def delete_prefix(self, prefix: str | bytes) -> etcdrpc.DeleteRangeResponse:
        start = to_bytes(prefix)
        ops = [self.transactions.delete(start, prefix_range_end(start))]
        return self.transaction([], ops, [])[1][0].response_delete_range

    def transaction(
        self, compare: list[Any], success: list[Any] | None = None, failure: list[Any] | None = None
    ) -> tuple[bool, list[Any]]:
        self._check()
        if success is None or failure is None:  # as etcd3's client fails
            raise TypeError("'NoneType' object is not iterable")
        with self._lock:
            ok = all(self._compare(c.build_message()) for c in compare)
            ops = success if ok else failure
            for op in ops:  # etcd refuses the whole transaction, before any change
                lease = lease_to_id(getattr(op, "lease", None))
                if isinstance(op, etcd3.transactions.Put) and lease and lease not in self._leases:
                    raise LeaseNotFound()
            events: list[Event] = []
            revision = self._revision + 1
            responses: list[Any] = []
            for op in ops:
                responses.append(self._apply(op, revision, events))
            if events:
                self._revision = revision
                self._record(events)
            header = etcdrpc.ResponseHeader(revision=self._revision)
        self._dispatch()
        done: list[Any] = []
        for response in responses:  # shaped as etcd3's client shapes them
            if isinstance(response, list):
                done.append([(kv.value, KVMetadata(kv, header)) for kv in response])
            else:
                getattr(response, response.WhichOneof("response")).header.CopyFrom(header)
                done.append(response)
        return ok, done

    def lease(self, ttl: int, lease_id: int | None = None) -> Lease:
        self._check()
        with self._lock:
            if lease_id is None:
                self._next_lease += 1
                lease_id = self._next_lease
            self._leases[lease_id] = _Lease(ttl)
        return Lease(lease_id=lease_id, ttl=ttl, etcd_client=self)

    def refresh_lease(self, lease_id: int) -> Iterator[etcdrpc.LeaseKeepAliveResponse]:
        self._check()
        with self._lock:
            lease = self._leases.get(lease_id)
        yield etcdrpc.LeaseKeepAliveResponse(ID=lease_id, TTL=lease.ttl if lease else 0)

    def revoke_lease(self, lease_id: int) -> None:
        self._check()
        with self._lock:
            if lease_id not in self._leases:
                raise LeaseNotFound()
            self._drop_lease(lease_id)
        self._dispatch()

    def get_lease_info(self, lease_id: int) -> etcdrpc.LeaseTimeToLiveResponse:
        self._check()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return etcdrpc.LeaseTimeToLiveResponse(ID=lease_id, TTL=-1)
            return etcdrpc.LeaseTimeToLiveResponse(
                ID=lease_id, TTL=lease.ttl, grantedTTL=lease.ttl, keys=sorted(lease.keys)
            )

    def add_watch_prefix_callback(
        self, prefix: str | bytes, callback: Callable[[Any], None], **kwargs: Any
    ) -> int:
        start = to_bytes(prefix)
        return self.add_watch_callback(start, callback, range_end=prefix_range_end(start), **kwargs)

    def add_watch_callback(
        self,
        key: str | bytes,
        callback: Callable[[Any], None],
        range_end: bytes | None = None,
        start_revision: int | None = None,
    ) -> int:
        self._check()
        watch = _Watch(to_bytes(key), range_end, callback)
        with self._lock:
            self._next_watch += 1
            watch_id = self._next_watch
            self._watches[watch_id] = watch
            if start_revision is not None and start_revision < self._compacted:
                # as etcd: the watch is made, then ends at once with the compaction
                watch.ended = True
                watch.backlog.append(etcd3.exceptions.RevisionCompactedError(self._compacted))
            for revision, events in self._history:
                if start_revision is not None and revision >= start_revision and not watch.ended:
                    self._notify(watch, revision, events)
        self._dispatch()
        return watch_id

    def cancel_watch(self, watch_id: int) -> None:
        self._check()
        with self._lock:
            watch = self._watches.pop(watch_id, None)
            if watch is not None:
                watch.cancelled = True

    def watch_once(self, key: str | bytes, timeout: float | None = None) -> Any:
        got: list[Any] = []
        done = threading.Event()

        def one(response: Any) -> None:
            if not got:
                got.append(response)
                done.set()

        watch_id = self.add_watch_callback(key, one)
        try:
            if not done.wait(timeout):
                raise etcd3.exceptions.WatchTimedOut()
        finally:
            with contextlib.suppress(etcd3.exceptions.Etcd3Exception):
                self.cancel_watch(watch_id)
        if not isinstance(got[0], WatchResponse):
            raise etcd3.exceptions.ConnectionFailedError()
        return got[0].events[0]

    # -- the store (under self._lock) ------------------------------------------------------

    def _range(self, start: bytes, end: bytes | None) -> etcdrpc.RangeResponse:
        self._check()
        with self._lock:
            kvs = self._select(start, end)
            header = etcdrpc.ResponseHeader(revision=self._revision)
            return etcdrpc.RangeResponse(header=header, kvs=kvs, count=len(kvs))

    def _range_at(self, key: bytes, revision: int) -> etcdrpc.RangeResponse:
        """``key`` as it was at ``revision``, replayed from the history."""
        self._check()
        with self._lock:
            if revision < self._compacted:
                raise Compacted()
            found: KeyValue | None = None
            for at, events in self._history:
                if at > revision:
                    break
                for event in events:
                    if event.kv.key == key:
                        found = event.kv if event.type == _PUT else None
            header = etcdrpc.ResponseHeader(revision=self._revision)
            kvs = [] if found is None else [found]
            return etcdrpc.RangeResponse(header=header, kvs=kvs, count=len(kvs))

    def _select(self, key: str | bytes, range_end: str | bytes | None) -> list[KeyValue]:
        start, end = to_bytes(key), None if range_end is None else to_bytes(range_end)
        return [kv for k, kv in sorted(self._kvs.items()) if _covers(start, end, k)]

    def _compare(self, c: etcdrpc.Compare) -> bool:
        kv = self._kvs.get(c.key) or KeyValue(key=c.key)  # absent: version 0, revisions 0
        field = _TARGETS[c.target]
        return bool(_RESULTS[c.result](getattr(kv, field), getattr(c, field)))

    def _apply(self, op: Any, revision: int, events: list[Event]) -> Any:
        if isinstance(op, etcd3.transactions.Put):
            key, lease = to_bytes(op.key), lease_to_id(op.lease)
            old = self._kvs.get(key)
            if old is not None and old.lease and old.lease in self._leases:
                self._leases[old.lease].keys.discard(key)
            kv = KeyValue(
                key=key,
                value=to_bytes(op.value),
                lease=lease,
                mod_revision=revision,
                create_revision=old.create_revision if old else revision,
                version=old.version + 1 if old else 1,
            )
            self._kvs[key] = kv
            if lease:
                self._leases[lease].keys.add(key)
            events.append(Event(type=_PUT, kv=kv))
            return etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse())
        if isinstance(op, etcd3.transactions.Get):
            return self._select(op.key, op.range_end)
        if isinstance(op, etcd3.transactions.Delete):
            gone = [kv.key for kv in self._select(op.key, op.range_end)]
            for key in gone:
                self._delete(key, revision, events)
            response = etcdrpc.DeleteRangeResponse(deleted=len(gone))
            return etcdrpc.ResponseOp(response_delete_range=response)
        raise TypeError(f"the fake etcd does not do {type(op).__name__} in a transaction")

    def _delete(self, key: bytes, revision: int, events: list[Event]) -> None:
        kv = self._kvs.pop(key)
        if kv.lease in self._leases:
            self._leases[kv.lease].keys.discard(key)
        gone = KeyValue(key=key, mod_revision=revision)
        events.append(Event(type=_DELETE, kv=gone))

    def _drop_lease(self, lease_id: int) -> None:
        """The lease and its keys go, in one revision (as a revoke or an expiry does)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None or not lease.keys:
            return
        events: list[Event] = []
        revision = self._revision + 1
        for key in sorted(lease.keys):
            self._delete(key, revision, events)
        self._revision = revision
        self._record(events)

    def _record(self, events: list[Event]) -> None:
        self._history.append((self._revision, events))
        for watch in self._watches.values():
            if not watch.ended:
                self._notify(watch, self._revision, events)

    def _notify(self, watch: _Watch, revision: int, events: list[Event]) -> None:
        mine = [e for e in events if _covers(watch.start, watch.end, e.kv.key)]
        if mine:
            header = etcdrpc.ResponseHeader(revision=revision)
            watch.backlog.append(WatchResponse(header, [new_event(e) for e in mine]))

    # -- delivery (outside self._lock) -----------------------------------------------------

    def _dispatch(self) -> None:
        """Deliver what the watches have waiting, one thread at a time, in order.

        A thread that finds another one delivering leaves it to that one, which looks
        again once it is done: nothing is left behind, and a callback that writes to etcd
        does not deadlock."""
        while True:
            with self._lock:
                pending = [w for w in self._watches.values() if w.backlog]
            if not pending or not self._dispatching.acquire(blocking=False):
                return
            try:
                for watch in pending:
                    self._deliver(watch)
            finally:
                self._dispatching.release()

    def _deliver(self, watch: _Watch) -> None:
        while True:
            with self._lock:
                if not watch.backlog:
                    if watch.ended:  # its error is delivered: the watch is over
                        self._watches = {i: w for i, w in self._watches.items() if w is not watch}
                    return
                response = watch.backlog.popleft()
            if not watch.cancelled:
                _safe(watch.callback, response)


def _safe(callback: Callable[[Any], None], response: Any) -> None:
    try:
        callback(response)
    except Exception:
        log.exception("watch callback failed")  # as etcd3's watcher does


_CHECKED: type[EtcdClient] = FakeEtcd  # mypy --strict checks the fake against the protocol
