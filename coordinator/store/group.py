"""The store of a stream's group keys: every etcd transaction on them goes through it.

Membership, claims, hand-overs and parked records for the consumers; the election's
candidate key and the leader's writes (the assignment, the standbys, the deletion of
forged keys), each fenced on the leader's candidate key
(:class:`partq.coordinator.store.election.Fence`),
for the coordinator; a snapshot and a watch for both. Callers never build a transaction
or a key string. It talks to etcd through :class:`partq.kernel.etcd.EtcdClient` (in unit tests,
:class:`tests.fakes.etcd.FakeEtcd`); which key is of which kind, and how it is decoded
and mirrored, comes from :data:`partq.coordinator.store.kinds.KINDS`.
Values go through :mod:`partq.coordinator.store.codec`, decoded once here into typed frozen
values. A value partq did not write (not JSON, or the wrong shape) is treated as
absent: it is logged at warning once per key and revision, counted in
``partq_etcd_malformed_values_total{stream,kind}`` and listed in
:attr:`GroupState.malformed` (``partq status`` shows it); nothing raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import etcd3.exceptions
from partq.coordinator import metrics
from partq.coordinator.store import codec, kinds
from partq.coordinator.store.codec import (
    Assignment,
    Candidate,
    Claim,
    Drain,
    LoadReport,
    Member,
    Move,
    Parked,
    Pause,
    Rebalance,
    Request,
    Value,
    validate_member_id,
)
from partq.coordinator.store.election import Fence
from partq.coordinator.store.kinds import Malformed, WatchEvent, kind_of
from partq.coordinator.store.mirror import GroupMirror, GroupState
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from partq.kernel.errors import (
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    MalformedValue,
    MemberIdTaken,
    NotHolder,
)
from partq.kernel.etcd import EtcdClient, etcd_errors, lease_is, translate

__all__ = [
    "Assignment",
    "Candidate",
    "Claim",
    "Drain",
    "Group",
    "GroupState",
    "Malformed",
    "Member",
    "Move",
    "Parked",
    "Pause",
    "Rebalance",
    "Request",
    "WatchEvent",
    "validate_member_id",
]

log = logging.getLogger("partq.group")
_TXN_OPS = 100  # keys per transaction, at most: etcd's default --max-txn-ops is 128


class _Reported:
    """(key, mod revision) pairs already logged and counted in this process (bounded)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()

    def first(self, key: str, revision: int) -> bool:
        with self._lock:
            if (key, revision) in self._seen:
                return False
            if len(self._seen) >= self.LIMIT:
                self._seen.clear()
            self._seen.add((key, revision))
            return True


_reported = _Reported()


class Group:
    """One stream's group keys.

    ``report``: log and count malformed values (the daemons); ``partq status`` and the
    status page only list them.
    """

    def __init__(self, client: EtcdClient, where: str, stream: str, *, report: bool = True) -> None:
        self.client = client
        self.where = where
        self.stream = stream  # the group's scope (partq.producer.contract.group_scope)
        self._key_watches: dict[int, list[int]] = {}  # a prefix watch's key watches
        self.report = report

    # -- decoding ----------------------------------------------------------------------

    def _decode(
        self, kind: str, name: str, key: str, raw: bytes, lease: int, revision: int
    ) -> Value | Malformed:
        try:
            return kinds.decode(kind, self.stream, name, raw, lease)
        except MalformedValue as e:
            bad = Malformed(key, kind, str(e), revision)
            if self.report and _reported.first(key, revision):
                log.warning(
                    "malformed value at %s (revision %d): %s; ignoring it (treated as absent)",
                    key,
                    revision,
                    bad.error,
                )
                metrics.MALFORMED_VALUES.labels(self.stream, kind).inc()
            return bad

    # -- reading -----------------------------------------------------------------------

    def snapshot(self) -> GroupState:
        with etcd_errors(self.where):
            response = self.client.get_prefix_response(keys.stream_prefix(self.stream))
            stored = [
                (kv.key, kv.value, kv.lease, kv.mod_revision, kv.create_revision)
                for kv in response.kvs
            ]
            for key in self._stream_keys():  # the stream's spec and resize, at that revision
                at, meta = self.client.get(key, revision=int(response.header.revision))
                if at is not None:
                    stored.append(
                        (meta.key, at, meta.lease_id, meta.mod_revision, meta.create_revision)
                    )
        malformed: dict[str, Malformed] = {}
        events: list[WatchEvent] = []
        for raw_key, raw, lease, mod_revision, create_revision in stored:
            key = raw_key.decode("utf-8", errors="replace")
            found = kind_of(self.stream, key)
            if found is None:
                continue
            row, name = found
            value = self._decode(row.kind, name, key, raw, lease, mod_revision)
            if isinstance(value, Malformed):
                malformed[key] = value
                continue
            events.append(
                WatchEvent(row.kind, name, value, lease, mod_revision, None, create_revision)
            )
        return GroupMirror.load(int(response.header.revision), events, malformed)

    def read_claim(self, partition: int) -> tuple[Claim | None, int]:
        """The claim on ``partition`` (None: none, or malformed) and its mod revision."""
        key = keys.claim(self.stream, partition)
        with etcd_errors(self.where):
            raw, meta = self.client.get(key)
        if raw is None:
            return None, 0
        value = self._decode(
            "claim", f"{partition:05d}", key, raw, meta.lease_id, meta.mod_revision
        )
        return (value if isinstance(value, Claim) else None), int(meta.mod_revision)

    def watch(self, revision: int, callback: Callable[[WatchEvent | Exception], None]) -> int:
        """Call ``callback`` for every change after ``revision`` (or with an error)."""

        def on_response(response: Any) -> None:
            if response is None or isinstance(response, Exception):  # the stream ended
                callback(self._watch_ended(response))
                return
            for event in response.events:
                key = event.key.decode("utf-8", errors="replace")
                found = kind_of(self.stream, key)
                if found is None:
                    continue
                kind, name = found[0].kind, found[1]
                lease = getattr(event, "lease", 0)
                value: Value | Malformed | None = None
                if type(event).__name__ != "DeleteEvent":
                    value = self._decode(kind, name, key, event.value, lease, event.mod_revision)
                if not kinds.valid_name(kind, name):
                    continue  # a key partq never uses (reported if put): no event about it
                created = getattr(event, "create_revision", 0)
                if isinstance(value, Malformed):
                    callback(
                        WatchEvent(
                            kind, name, None, lease, event.mod_revision, value.error, created
                        )
                    )
                else:
                    callback(
                        WatchEvent(kind, name, value, lease, event.mod_revision, None, created)
                    )

        with etcd_errors(self.where):
            watch_id: int = self.client.add_watch_prefix_callback(
                keys.stream_prefix(self.stream), on_response, start_revision=revision + 1
            )
            # a group's own prefix holds neither: the stream's spec and resize, key by key
            self._key_watches[watch_id] = [
                self.client.add_watch_callback(key, on_response, start_revision=revision + 1)
                for key in self._stream_keys()
            ]
        return watch_id

    def _stream_keys(self) -> tuple[str, ...]:
        """The stream's keys a group other than the default one reads outside its prefix."""
        if keys.stream_of(self.stream) == self.stream:  # the default group: under its prefix
            return ()
        return keys.spec(self.stream), keys.resize(self.stream)

    def _watch_ended(self, error: Exception | None) -> EtcdError:
        """Why a watch stream ended: etcd's refusal (not retried) or its compaction of the
        revisions still to come (resync from a fresh read) as such, else unavailable."""
        found = translate(error, self.where) if error is not None else None
        if isinstance(found, EtcdCompacted) or (found is not None and not found.retryable):
            return found
        return EtcdUnavailable(f"watch on {self.stream} ended: {error}")

    def cancel_watch(self, watch_id: int) -> None:
        for each in (watch_id, *self._key_watches.pop(watch_id, ())):
            try:
                with etcd_errors(self.where):
                    self.client.cancel_watch(each)
            except EtcdError:
                pass

    # -- membership --------------------------------------------------------------------

    def join(
        self,
        session: Session,
        member_id: str,
        weight: int = 1,
        version: str = "",
        *,
        priority: bool = False,
    ) -> None:
        """Register ``member_id`` on ``session``'s lease; refused if another live one has it.

        The id must pass :func:`validate_member_id` (:class:`InvalidMemberId` otherwise). A
        key left by a crashed instance of the same member (a restarted pod) is waited out
        once, for at most its lease's remaining TTL.
        """
        validate_member_id(member_id)
        existing = self._try_join(session, member_id, weight, version, priority)
        if existing is None:
            return
        with etcd_errors(self.where):
            remaining = self.client.get_lease_info(existing).TTL
        deadline = time.monotonic() + max(0, remaining) + 2  # TTL is truncated; expiry ticks
        log.info(
            "member id %s is held by lease %x for up to %ss: waiting",
            member_id,
            existing,
            remaining,
        )
        while existing is not None and (left := deadline - time.monotonic()) > 0:
            with etcd_errors(self.where), contextlib.suppress(etcd3.exceptions.WatchTimedOut):
                self.client.watch_once(keys.member(self.stream, member_id), timeout=left)
            existing = self._try_join(session, member_id, weight, version, priority)
        if existing is None:
            return
        raise MemberIdTaken(
            f"member id {member_id!r} is already used by a live consumer of {self.stream!r} "
            f"(lease {existing:x}): give this one another --member-id, or stop the other one"
        )

    def _try_join(
        self, session: Session, member_id: str, weight: int, version: str, priority: bool = False
    ) -> int | None:
        """Put the member key if absent; None if it is ours now, else the holder's lease."""
        if weight < 1:
            raise ValueError(f"weight must be at least 1, got {weight}")
        key = keys.member(self.stream, member_id)
        value = codec.encode_member(_this_process(member_id, weight, version, priority))
        ok, existing = self._put_if_absent(key, value, session, "member")
        if ok or existing is None or existing.lease_id == session.id:
            return None
        return int(existing.lease_id)

    def _put_if_absent(self, key: str, value: str, session: Session, kind: str) -> tuple[Any, Any]:
        """Put ``value`` on our lease if ``key`` is absent, or if it holds a value partq never
        writes (malformed, or a claim on no lease): it is nobody's claim or membership.

        (the put's response if done else None, the metadata of the value found or None).
        """
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.version(key) == 0],
                success=[t.put(key, value, lease=session.lease)],
                failure=[t.get(key)],
            )
        if ok:
            return responses[0], None
        if not responses or not responses[0]:
            return None, None
        raw, existing = responses[0][0]
        name = key.rsplit("/", 1)[1]
        try:
            kinds.decode(kind, self.stream, name, raw, existing.lease_id)
            if kind == "claim" and not existing.lease_id:
                raise MalformedValue("a claim on no lease (policy.forged_claims)")
        except MalformedValue as e:
            with etcd_errors(self.where):
                ok, responses = self.client.transaction(
                    compare=[t.mod(key) == existing.mod_revision],
                    success=[t.put(key, value, lease=session.lease)],
                    failure=[],
                )
            if ok:
                log.warning("replaced the malformed value at %s (%s)", key, e)
                return responses[0], None
        return None, existing

    def _if_ours(self, key: str, session: Session, op: Any) -> tuple[bool, list[Any]]:
        """``op`` (a put or delete of ``key``) only while ``key`` is on our session's lease:
        (done, the transaction's responses)."""
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[lease_is(key, session.id)], success=[op], failure=[]
            )
        return bool(ok), responses

    def announce_leaving(self, member: Member, session: Session) -> bool:
        """Mark our member key ``leaving`` (only if it is still on our lease): the leader
        then moves our partitions away at once, while we go on consuming them."""
        key = keys.member(self.stream, member.id)
        value = codec.encode_member(dataclasses.replace(member, leaving=True))
        ok, _ = self._if_ours(
            key, session, self.client.transactions.put(key, value, lease=session.lease)
        )
        return ok

    def restore_member(
        self,
        session: Session,
        member_id: str,
        weight: int,
        version: str,
        *,
        priority: bool = False,
        leaving: bool = False,
    ) -> bool:
        """Put our member key back as :meth:`join` wrote it (``leaving`` once announced),
        only while it is on our lease: another identity changed it (etcd 3.4 checks no lease
        inside a transaction)."""
        key = keys.member(self.stream, member_id)
        member = _this_process(member_id, weight, version, priority)
        value = codec.encode_member(dataclasses.replace(member, leaving=leaving))
        put = self.client.transactions.put(key, value, lease=session.lease)
        return self._if_ours(key, session, put)[0]

    def leave(self, member_id: str, session: Session) -> None:
        key = keys.member(self.stream, member_id)
        self._if_ours(key, session, self.client.transactions.delete(key))

    # -- claims ------------------------------------------------------------------------

    def claim(self, partition: int, member_id: str, session: Session) -> int:
        """Create our claim on ``partition`` if nobody holds one.

        Returns the claim's mod revision if it is ours now (truthy), else 0. A
        caller mirroring the claims from the watch ignores events up to that
        revision: they are older than what it knows. A malformed value at the claim
        key is nobody's claim: it is replaced.
        """
        key = keys.claim(self.stream, partition)
        value = codec.encode_claim(member_id, time.time())
        put, existing = self._put_if_absent(key, value, session, "claim")
        if put is not None:
            return int(put.response_put.header.revision)
        if existing is not None and existing.lease_id == session.id:
            return int(existing.mod_revision)
        return 0

    def take_over(
        self,
        partition: int,
        member_id: str,
        session: Session,
        seen: int,
        owner: str = "",
        *,
        priority: int = 0,
    ) -> int:
        """Put our claim on ``partition`` if its claim is still the one read at mod
        revision ``seen``: with ``owner`` a takeover claim naming the dead owner; without,
        our own takeover claim made ordinary, or an heir's claim (``priority``: the x-priority
        it consumes with, ``partq.consumers.state.priority``). The claim's new revision, or 0."""
        key = keys.claim(self.stream, partition)
        # live: the taker consumes already (an activated standby or heir, or its own claim)
        value = codec.encode_claim(
            member_id, time.time(), taken_from=owner, priority=priority, live=True
        )
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.mod(key) == seen],
                success=[t.put(key, value, lease=session.lease)],
                failure=[],
            )
        return int(responses[0].response_put.header.revision) if ok else 0

    def seal(self, partition: int, session: Session, claim: Claim) -> int:
        """Rewrite our ``claim`` on ``partition`` sealed (only if it is still on our lease),
        before its consumer is cancelled: an heir subscribed above us by priority, which the
        cancel may activate, then cannot take it over while we still handle what we hold
        (``partq.consumers.state.priority``). The claim's new revision, or 0."""
        return self._rewrite(partition, session, dataclasses.replace(claim, sealed=True))

    def mark_live(self, partition: int, session: Session, claim: Claim) -> int:
        """Rewrite our ``claim`` on ``partition`` live (only if it is still on our lease),
        once its consumer is subscribed: a hot standby stands by only behind a live claim,
        so it subscribes behind our consumer, not behind the last owner's that a cancel is
        about to end (``partq.consumers.state.standby``). The claim's new revision, or 0."""
        return self._rewrite(partition, session, dataclasses.replace(claim, live=True))

    def _rewrite(self, partition: int, session: Session, claim: Claim) -> int:
        key = keys.claim(self.stream, partition)
        value = codec.encode_claim(
            claim.member,
            time.time(),
            taken_from=claim.taken_from,
            priority=claim.priority,
            sealed=claim.sealed,
            live=claim.live,
        )
        put = self.client.transactions.put(key, value, lease=session.lease)
        ok, responses = self._if_ours(key, session, put)
        return int(responses[0].response_put.header.revision) if ok else 0

    def release(self, partition: int, session: Session) -> int:
        """Delete our claim on ``partition`` (only if it is ours): the delete's revision, or 0."""
        key = keys.claim(self.stream, partition)
        ok, responses = self._if_ours(key, session, self.client.transactions.delete(key))
        return int(responses[0].response_delete_range.header.revision) if ok else 0

    def hand_over(self, partition: int, session: Session, to: Member) -> int:
        """Turn our claim on ``partition`` into ``to``'s, on ``to``'s lease, in one step,
        while ``to``'s member key still sits on that lease: the next owner finds the
        partition claimed for it and subscribes without a claim of its own. The claim's
        revision, or 0 (not ours, or ``to`` gone or restarted: release it instead)."""
        key = keys.claim(self.stream, partition)
        value = codec.encode_claim(to.id, time.time())
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[
                    lease_is(key, session.id),
                    lease_is(keys.member(self.stream, to.id), to.lease),
                ],
                success=[t.put(key, value, lease=to.lease)],
                failure=[],
            )
        return int(responses[0].response_put.header.revision) if ok else 0

    # -- the election and the leader's writes, fenced on its candidate key ----------------

    def stand(self, session: Session) -> Fence:
        """Put our candidate key on ``session``'s lease if absent (else keep the one there,
        ours from before): the fence of the leader's writes
        (:mod:`partq.coordinator.store.election`)."""
        key = keys.leader_candidate(self.stream, session.id)
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.create(key) == 0],
                success=[t.put(key, codec.encode_candidate(), lease=session.lease)],
                failure=[t.get(key)],
            )
        if ok:
            return Fence(key, int(responses[0].response_put.header.revision))
        return Fence(key, int(responses[0][0][1].create_revision))

    def resign(self, fence: Fence) -> None:
        """Delete our candidate key if it is still the one ``fence`` names."""
        self._fenced(fence, [(0, self.client.transactions.delete(fence.key))])

    def assign(self, fence: Fence, owners: Mapping[int, str]) -> list[int]:
        """Write each partition's owner: the partitions written, all of them unless a
        transaction found another leader (see :meth:`_fenced`)."""
        t = self.client.transactions
        puts = [
            (p, t.put(keys.assignment(self.stream, p), codec.encode_assignment(owner)))
            for p, owner in owners.items()
        ]
        return self._fenced(fence, puts, timed="assign")

    def unassign(self, fence: Fence, partitions: Sequence[int]) -> list[int]:
        """Delete the assignment of each of ``partitions`` (a resize retired them): the
        partitions done, all of them unless a transaction found another leader."""
        t = self.client.transactions
        ops = [(p, t.delete(keys.assignment(self.stream, p))) for p in partitions]
        return self._fenced(fence, ops)

    def name_standbys(self, fence: Fence, changes: Sequence[tuple[int, str | None]]) -> list[int]:
        """Put each partition's hot standby (None: delete its key), in order: the partitions
        written, all of them unless a transaction found another leader."""
        t = self.client.transactions
        ops = [
            (
                p,
                t.delete(keys.standby(self.stream, p))
                if member is None
                else t.put(keys.standby(self.stream, p), codec.encode_standby(member)),
            )
            for p, member in changes
        ]
        return self._fenced(fence, ops)

    def remove_claim(self, fence: Fence, partition: int, revision: int) -> bool:
        """Delete the claim on ``partition`` if it is still at ``revision`` and we lead."""
        return self._remove(fence, keys.claim(self.stream, partition), revision)

    def remove_candidate(self, fence: Fence, name: str, revision: int) -> bool:
        """Delete another leader candidate key if it is still at ``revision`` and we lead."""
        return self._remove(fence, keys.leader_prefix(self.stream) + name, revision)

    def remove_parked(self, fence: Fence, key_id: str, revision: int) -> bool:
        """Delete a parked record if it is still at ``revision`` and we lead."""
        return self._remove(fence, keys.parked(self.stream, key_id), revision)

    def disown_parked(self, key_id: str, revision: int) -> bool:
        """Delete a parked record in our name that we never wrote, if it is still at
        ``revision`` (a consumer may delete under ``parked/``)."""
        key, t = keys.parked(self.stream, key_id), self.client.transactions
        with etcd_errors(self.where):
            ok, _ = self.client.transaction(
                compare=[t.mod(key) == revision], success=[t.delete(key)], failure=[]
            )
        return bool(ok)

    def _remove(self, fence: Fence, key: str, revision: int) -> bool:
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, _ = self.client.transaction(
                compare=[fence.compare(t), t.mod(key) == revision],
                success=[t.delete(key)],
                failure=[],
            )
        return bool(ok)

    def _fenced(
        self, fence: Fence, ops: Sequence[tuple[int, Any]], timed: str | None = None
    ) -> list[int]:
        """Carry out ``ops`` (each with the partition it is about) in transactions of at
        most ``_TXN_OPS``, each fenced on ``fence``: the partitions done. A transaction that
        finds another leader ends it (nothing after it is tried). ``timed``: the label of
        ``partq_etcd_seconds`` each transaction is timed under."""
        t = self.client.transactions
        done: list[int] = []
        for start in range(0, len(ops), _TXN_OPS):
            chunk = ops[start : start + _TXN_OPS]
            began = time.monotonic()
            with etcd_errors(self.where):
                ok, _ = self.client.transaction(
                    compare=[fence.compare(t)], success=[op for _, op in chunk], failure=[]
                )
            if timed is not None:
                metrics.ETCD_SECONDS.labels(timed).observe(time.monotonic() - began)
            if not ok:
                break
            done += [p for p, _ in chunk]
        return done

    # -- parked keys (on_failure = park) --------------------------------------------------

    def park(self, parked: Parked, session: Session) -> int:
        """Record ``parked`` unless its key is parked already, while our claim on its
        partition is on ``session``'s lease (what
        :func:`partq.coordinator.leader.policy.parked_by_holder`
        checks): the revision at which the key is parked (ours, or the earlier record's).
        :class:`NotHolder` if the key is not parked and the claim is not ours."""
        key = keys.parked(self.stream, parked.key_id)
        value = codec.encode_parked(parked)
        t = self.client.transactions
        claim = keys.claim(self.stream, parked.partition)
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.version(key) == 0, lease_is(claim, session.id)],
                success=[t.put(key, value)],
                failure=[t.get(key)],
            )
        if ok:
            return int(responses[0].response_put.header.revision)
        found = responses[0][0][1] if responses and responses[0] else None
        if found is None:
            raise NotHolder(
                f"cannot park a key of partition {parked.partition}: its claim is no longer "
                f"ours; its next owner handles the message"
            )
        return int(found.mod_revision)

    def parked_at(
        self, record: Parked, revision: int
    ) -> tuple[Claim | None, Member | None, StreamSpec | None]:
        """The claim on ``record``'s partition, the record's member and the stream's spec as
        they were at ``revision`` (the record's): the facts
        :func:`partq.coordinator.leader.policy.parked_by_holder` judges (the spec: the partition
        count
        the key was placed by, which a resize changes later). Raises
        :class:`EtcdUnavailable` if etcd compacted that revision away."""
        found: list[Value | Malformed | None] = []
        for kind, name, key in (
            ("claim", f"{record.partition:05d}", keys.claim(self.stream, record.partition)),
            ("member", record.member, keys.member(self.stream, record.member)),
            ("spec", self.stream, keys.spec(self.stream)),
        ):
            with etcd_errors(self.where):
                raw, meta = self.client.get(key, revision=revision)
            found.append(
                None
                if raw is None
                else self._decode(kind, name, key, raw, meta.lease_id, meta.mod_revision)
            )
        claim, member, spec = found
        return (
            claim if isinstance(claim, Claim) else None,
            member if isinstance(member, Member) else None,
            spec if isinstance(spec, StreamSpec) else None,
        )

    def report_redrive_failed(self, parked: Parked) -> int:
        """Put ``parked`` (the failed replay named in it) over the key's record if the key is
        still parked: the put's revision, or 0."""
        key = keys.parked(self.stream, parked.key_id)
        value = codec.encode_parked(parked)
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.version(key) > 0], success=[t.put(key, value)], failure=[]
            )
        return int(responses[0].response_put.header.revision) if ok else 0

    def unpark(self, key_id: str) -> int:
        """Delete a key's parked record: the delete's revision."""
        t = self.client.transactions
        with etcd_errors(self.where):
            _ok, responses = self.client.transaction(
                compare=[], success=[t.delete(keys.parked(self.stream, key_id))], failure=[]
            )
        return int(responses[0].response_delete_range.header.revision)

    def parked(self) -> dict[str, Parked]:
        """The stream's parked keys (key id -> record); malformed records are left out."""
        return dict(self.snapshot().parked)

    # -- load reports (the lag-aware assignment, the status page) -------------------------

    def report_load(self, report: LoadReport, session: Session) -> None:
        """Put ``report`` at the member's load key, on its lease (gone with the member)."""
        value = codec.encode_load(report)
        with etcd_errors(self.where):
            self.client.put(keys.load(self.stream, report.member), value, lease=session.lease)

    def loads(self) -> dict[str, LoadReport]:
        """Every member's latest load report (member id -> report); malformed ones are left
        out (and logged once, with ``report``)."""
        prefix = keys.loads(self.stream)
        with etcd_errors(self.where):
            found = list(self.client.get_prefix(prefix))
        out: dict[str, LoadReport] = {}
        for raw, meta in found:
            key = meta.key.decode("utf-8", errors="replace")
            try:
                report = codec.decode_load(key[len(prefix) :], raw)
            except MalformedValue as e:
                if self.report and _reported.first(key, int(meta.mod_revision)):
                    log.warning("malformed load report at %s: %s; ignoring it", key, e)
                    metrics.MALFORMED_VALUES.labels(self.stream, "load").inc()
                continue
            out[report.member] = report
        return out

    # -- operator requests (manual mode) --------------------------------------------------

    def request(self, request: Request) -> None:
        """Store an operator request for the leader (member ids are validated first)."""
        name, value = codec.encode_request(dataclasses.replace(request, at=time.time()))
        with etcd_errors(self.where):
            self.client.put(keys.request(self.stream, name), value)

    def clear_request(self, name: str) -> None:
        with etcd_errors(self.where):
            self.client.delete(keys.request(self.stream, name))

    def withdraw(self, request: Request) -> bool:
        """Delete ``request``'s key if it holds that kind of request (for a drain: of that
        member) at the revision read: False if there was none, or it changed meanwhile."""
        key = keys.request(self.stream, request.name)
        with etcd_errors(self.where):
            raw, meta = self.client.get(key)
        if raw is None:
            return False
        found = self._decode("request", request.name, key, raw, 0, meta.mod_revision)
        if type(found) is not type(request):
            return False
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, _ = self.client.transaction(
                compare=[t.mod(key) == meta.mod_revision], success=[t.delete(key)], failure=[]
            )
        return bool(ok)

    # -- coordinators' policies (``partq rebalance``/``pause`` compare them) ---------------

    def announce_policy(self, session: Session, policy: Mapping[str, codec.Policy]) -> None:
        """Put a coordinator's policy beside its candidate key, on the same lease."""
        value = codec.encode_policy(policy)
        with etcd_errors(self.where):
            self.client.put(keys.policy(self.stream, session.id), value, lease=session.lease)

    def policies(self) -> dict[str, dict[str, codec.Policy]]:
        """The coordinators' policies by candidate name (lease in hex); malformed ones are
        left out."""
        prefix = keys.policies(self.stream)
        with etcd_errors(self.where):
            found = list(self.client.get_prefix(prefix))
        out: dict[str, dict[str, codec.Policy]] = {}
        for raw, meta in found:
            name = meta.key.decode("utf-8", errors="replace")[len(prefix) :]
            with contextlib.suppress(MalformedValue):
                out[name] = codec.decode_policy(raw)
        return out


def _this_process(member_id: str, weight: int, version: str, priority: bool) -> Member:
    """The member key of this process, as it joins (and puts it back)."""
    return Member(
        id=member_id,
        weight=weight,
        host=socket.gethostname(),
        pid=os.getpid(),
        version=version,
        started=time.time(),
        priority=priority,
    )
