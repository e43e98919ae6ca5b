"""One mirror of a stream's group keys, kept current by the watch: the coordinator's and
the consumer daemon's view of members, assignment, claims, candidates and requests.

A :class:`GroupState` holds a stream's group keys by kind, in the fields the table
:data:`partq.coordinator.store.kinds.KINDS` names; a snapshot
(:meth:`partq.coordinator.store.group.Group.snapshot`)
is one, read as changes through :meth:`GroupMirror.load`. A mirror is built from a snapshot
(:meth:`GroupMirror.of`), then :meth:`GroupMirror.apply` each
:class:`partq.coordinator.store.kinds.WatchEvent` after it. Values arrive decoded (once, in
:class:`partq.coordinator.store.group.Group`); a malformed one (``value`` None) is an absent key,
like a
deleted one.

Claims :func:`partq.coordinator.leader.policy.forged_claims` (on no lease, or on another live
member's
lease) are kept apart in ``forged`` with their revision, for the leader to delete: every
reader of ``claims`` sees them as absent. Whether a claim is forged depends on the members'
leases, so a member change sorts the claims again.

A client that writes a key mirrors its own write at once rather than wait for the echo
(:meth:`GroupMirror.wrote_claim`); watch events about that key up to the write's
revision are older than what the mirror knows, and are skipped.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from partq.coordinator.leader.policy import forged_claims
from partq.coordinator.leader.resize import State as ResizeState
from partq.coordinator.store.codec import Claim, Drained, Member, Parked, Pause, Request
from partq.coordinator.store.kinds import KINDS, Malformed, WatchEvent
from partq.producer.contract import StreamSpec

__all__ = ["GroupKeys", "GroupMirror", "GroupState"]


@dataclass
class GroupKeys:
    """A stream's group keys by kind (the fields :data:`partq.coordinator.store.kinds.KINDS`
    names), as
    they were at ``revision``."""

    revision: int = field(default=0, compare=False)  # what the keys are, not when
    members: dict[str, Member] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)  # partition -> owner
    claims: dict[int, Claim] = field(default_factory=dict)  # forged ones left out
    forged: dict[int, Claim] = field(default_factory=dict)  # policy.forged_claims: ignored
    standbys: dict[int, str] = field(default_factory=dict)  # partition -> hot standby member
    claim_revisions: dict[int, int] = field(default_factory=dict)  # of claims and forged
    candidates: dict[str, int] = field(default_factory=dict)  # name -> create revision
    requests: dict[str, Request] = field(default_factory=dict)
    parked: dict[str, Parked] = field(default_factory=dict)  # key id -> record
    parked_revisions: dict[str, int] = field(default_factory=dict)  # key id -> mod revision
    drained: dict[str, Drained] = field(default_factory=dict)  # "<epoch>/<p>" -> a resize's fence
    spec: StreamSpec | None = None  # None: deleted, or malformed
    resize: ResizeState | None = (
        None  # the last resize's record (partq.coordinator.leader.resize), if any
    )

    @property
    def leaders(self) -> list[tuple[int, str]]:
        """The leader candidates as (create revision, name), the leader first; none of
        :attr:`foreign_candidates`."""
        foreign = self.foreign_candidates
        return sorted((r, name) for name, r in self.candidates.items() if name not in foreign)

    @property
    def foreign_candidates(self) -> dict[str, int]:
        """Candidates on a lease that holds a member key: a consumer's lease, put inside a
        transaction (etcd 3.4 checks no lease there). A coordinator campaigns on a lease
        of its own, so such a key never leads, and the leader deletes it."""
        leases = {m.lease for m in self.members.values() if m.lease}
        return {n: r for n, r in self.candidates.items() if int(n, 16) in leases}


@dataclass
class GroupState(GroupKeys):
    """One consistent read of a stream's group keys (a snapshot), and the keys read whose
    values partq did not write."""

    malformed: dict[str, Malformed] = field(default_factory=dict)  # key -> why


@dataclass
class GroupMirror(GroupKeys):
    """A stream's group keys kept current by the watch (the module docstring)."""

    # partition -> revision of our own latest claim write: older claim events are stale
    claim_writes: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, state: GroupKeys) -> GroupMirror:
        """The mirror of a snapshot; the watch from ``state.revision`` on keeps it current."""
        return cls(**{name: copy.copy(value) for name, value in _keys(state).items()})

    @classmethod
    def load(
        cls, revision: int, events: Iterable[WatchEvent], malformed: dict[str, Malformed]
    ) -> GroupState:
        """The state that ``events`` (one per key, read at ``revision``) make."""
        mirror = cls(revision=revision)
        for event in events:
            mirror._store(event)
        mirror._sort_claims()
        return GroupState(**_keys(mirror), malformed=malformed)

    def apply(self, event: WatchEvent) -> set[int]:
        """Mirror one change; the partitions whose assignment or claim it concerns."""
        if event.kind == "claim" and event.revision <= self.claim_writes.get(event.partition, 0):
            return set()  # older than our own claim or release
        before = self.requests.get(event.name) if event.kind == "request" else None
        self.revision = max(self.revision, event.revision)
        self._store(event)
        match event.kind:
            case "member":
                return self._sort_claims()
            case "claim":
                claim = self.claims.get(event.partition)
                if claim is not None and forged_claims(self.members, {event.partition: claim}):
                    self.forged[event.partition] = self.claims.pop(event.partition)
                return {event.partition}
            case "assignment" | "standby":
                return {event.partition}
            case "request":
                return _paused_partitions(before, self.requests.get(event.name), self.spec)
        return set()

    def _store(self, event: WatchEvent) -> None:
        """Put (or, for a deleted or malformed value, take out) the key in its kind's field."""
        row = KINDS[event.kind]
        held = row.held(event)
        if row.exact:
            setattr(self, row.mirror, held)
            return
        name = row.name(event.name)
        if event.kind == "claim":
            self.forged.pop(event.partition, None)  # sorted again by apply or load
        _put(getattr(self, row.mirror), name, held)
        if row.revisions is not None:
            revision = event.revision if held is not None else None
            _put(getattr(self, row.revisions), name, revision)

    def _sort_claims(self) -> set[int]:
        """Move claims between ``claims`` and ``forged`` as the members' leases say; the
        partitions moved."""
        every = self.forged | self.claims
        forged = forged_claims(self.members, every)
        moved = {p for p in every if (p in forged) != (p in self.forged)}
        for p in sorted(moved):
            if p in forged:
                self.forged[p] = self.claims.pop(p)
            else:
                self.claims[p] = self.forged.pop(p)
        return moved

    def wrote_claim(self, partition: int, claim: Claim | None, revision: int) -> None:
        """Mirror our own claim (or, None, our release) of ``partition``, done at ``revision``."""
        self.forged.pop(partition, None)
        _put(self.claims, partition, claim)
        _put(self.claim_revisions, partition, revision if claim else None)
        self.claim_writes[partition] = revision


def _paused_partitions(
    before: Request | None, after: Request | None, spec: StreamSpec | None
) -> set[int]:
    """The partitions a change of a pause request concerns."""
    found: set[int] = set()
    for request in (before, after):
        if isinstance(request, Pause):
            if request.partition is not None:
                found.add(request.partition)
            elif spec is not None:
                found.update(range(spec.partitions))
    return found


K = TypeVar("K")
V = TypeVar("V")


def _put(mapping: dict[K, V], key: K, value: V | None) -> None:
    if value is None:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _keys(state: GroupKeys) -> dict[str, Any]:
    """The fields of :class:`GroupKeys` in ``state``."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(GroupKeys)}
