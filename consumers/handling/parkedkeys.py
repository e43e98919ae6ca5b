"""The stream's parked keys as one consumer process knows them (``on_failure = park``).

:class:`ParkedKeys` mirrors the ``parked/<key id>`` records (docs in
:mod:`partq.consumers.handling.parking`): the daemon's snapshot and watch events, and the
workers' own writes, the latest revision winning for each key. :func:`written_by_holder`
says whether a watched record may be believed: only one its partition's holder wrote.

Threads. :class:`ParkedKeys` is written by the controller thread (the snapshot, watch
events) and by the workers' threads (their own writes, a keyed worker's pool threads),
and read by both, all under its lock. :func:`written_by_holder` runs on the controller
thread, on the mirror it alone owns.
"""

from __future__ import annotations

import logging
import threading

from partq.coordinator import metrics
from partq.coordinator.leader import policy
from partq.coordinator.store.codec import Parked
from partq.coordinator.store.group import Group
from partq.coordinator.store.mirror import GroupMirror

from partq.kernel.errors import EtcdUnavailable

__all__ = ["ParkedKeys", "disowned", "written_by_holder"]

log = logging.getLogger("partq.consumer.parking")


class ParkedKeys:
    """The stream's parked keys as this process knows them: the daemon's snapshot and watch
    events, and the workers' own writes; for each key the latest revision wins (a watch
    event older than our own write is stale)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, Parked] = {}
        self._revisions: dict[str, int] = {}
        self._expected: set[str] = set()  # keys whose record our workers write (expect)

    def expect(self, name: str) -> None:
        """A worker of ours is about to write key ``name``'s record: a watched record of it
        in our name is ours (``ours``), not one put with another identity's credentials."""
        with self._lock:
            self._expected.add(name)

    def ours(self, name: str) -> bool:
        """Whether our workers wrote (or are writing) key ``name``'s record."""
        with self._lock:
            return name in self._expected

    def reset(self, records: dict[str, Parked], revision: int) -> None:
        """A snapshot at ``revision``; our own writes after it stand."""
        with self._lock:
            for name in set(self._records) | set(records):
                if self._revisions.get(name, 0) > revision:
                    continue
                self._set(name, records.get(name), revision)

    def apply(self, name: str, record: Parked | None, revision: int) -> None:
        with self._lock:
            if revision > self._revisions.get(name, 0):
                self._set(name, record, revision)

    def _set(self, name: str, record: Parked | None, revision: int) -> None:
        self._revisions[name] = revision
        if record is None:
            self._expected.discard(name)
            self._records.pop(name, None)
        else:
            self._records[name] = record

    def get(self, name: str) -> Parked | None:
        with self._lock:
            return self._records.get(name)

    def on(self, partition: int) -> list[Parked]:
        with self._lock:
            return [r for r in self._records.values() if r.partition == partition]

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def written_by_holder(mirror: GroupMirror, record: Parked, revision: int, partitions: int) -> bool:
    """Whether the parked record put at ``revision`` is one its partition's holder wrote.
    ``mirror`` holds the group as it was just before (the watch delivers in revision order),
    unless our own claim write is newer: then the leader judges it (it deletes a record
    that fails). A record that fails is ignored: it would divert a key we may hold."""
    if record.partition < partitions and (mirror.claim_writes.get(record.partition, 0) >= revision):
        return True
    ok = policy.parked_by_holder(
        record,
        partitions,
        mirror.claims.get(record.partition),
        mirror.members.get(record.member),
    )
    if not ok:
        log.warning(
            "ignoring the parked record of key %s (revision %d): not written by the holder "
            "of partition %d (it names %s)",
            record.key_text,
            revision,
            record.partition,
            record.member,
        )
    return ok


def disowned(
    group: Group, parked: ParkedKeys, member: str, holds: bool, record: Parked, revision: int
) -> bool:
    """Whether ``record`` (put at ``revision``), in ``member``'s name (ours) and of a
    partition we hold (``holds``), is one our workers never wrote: put with another
    identity's credentials, it would park a key of ours unhandled. Deleted (if still at
    ``revision``), logged and counted, and never believed. (Of a partition held by another,
    its redrive may rewrite a record we wrote before: not ours to judge.)"""
    if record.member != member or not holds or parked.ours(record.key_id):
        return False
    log.warning(
        "deleting the parked record of key %s (partition %d) in our name: we never wrote "
        "it, so it was put with another identity's credentials",
        record.key_text,
        record.partition,
    )
    metrics.FORGED_REMOVED.labels(group.stream, "parked").inc()
    try:
        group.disown_parked(record.key_id, revision)
    except EtcdUnavailable as e:  # ignored all the same; the leader judges it too
        log.warning("cannot delete it yet: %s", e)
    return True
