"""One mirror of a stream's group keys, kept current by the watch: the coordinator's and
the consumer daemon's view of members, assignment, claims, candidates and requests.

Built from a snapshot (:meth:`GroupMirror.of` a :class:`coordinator.group.GroupState`),
then :meth:`GroupMirror.apply` each :class:`coordinator.group.WatchEvent` after it. Values
arrive decoded (:mod:`coordinator.codec`, once, in :class:`coordinator.group.Group`); a
malformed one (``value`` None) is an absent key, like a deleted one.

Claims :func:`coordinator.policy.forged_claims` (on no lease, or on another live member's
lease) are kept apart in ``forged`` with their revision, for the leader to delete: every
reader of ``claims`` sees them as absent. Whether a claim is forged depends on the members'
leases, so a member change sorts the claims again.

A client that writes a key mirrors its own write at once rather than wait for the echo
(:meth:`GroupMirror.wrote_claim`); watch events about that key up to the write's
revision are older than what the mirror knows, and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from coordinator.codec import (
    Assignment,
    Candidate,
    Claim,
    Drain,
    Member,
    Move,
    Parked,
    Pause,
    Rebalance,
    Request,
    Standby,
)
from coordinator.group import GroupState, WatchEvent
from coordinator.policy import forged_claims
from producer.contract import StreamSpec

__all__ = ["GroupMirror"]


@dataclass
class GroupMirror:
    members: dict[str, Member] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)  # partition -> owner
    claims: dict[int, Claim] = field(default_factory=dict)  # forged ones left out
    forged: dict[int, Claim] = field(default_factory=dict)
    claim_revisions: dict[int, int] = field(default_factory=dict)  # of claims and forged
    standbys: dict[int, str] = field(default_factory=dict)  # partition -> hot standby member
    candidates: dict[str, int] = field(default_factory=dict)  # name -> create revision
    requests: dict[str, Request] = field(default_factory=dict)
    parked: dict[str, Parked] = field(default_factory=dict)  # key id -> record
    parked_revisions: dict[str, int] = field(default_factory=dict)  # key id -> mod revision
    spec: StreamSpec | None = None  # None: deleted, or malformed
    # partition -> revision of our own latest claim write: older claim events are stale
    claim_writes: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, state: GroupState) -> GroupMirror:
        """The mirror of a snapshot; the watch from ``state.revision`` on keeps it current."""
        return cls(
            members=dict(state.members),
            assignment=dict(state.assignment),
            claims=dict(state.claims),
            forged=dict(state.forged),
            claim_revisions=dict(state.claim_revisions),
            standbys=dict(state.standbys),
            candidates={key.rsplit("/", 1)[1]: revision for revision, key in state.leaders},
            requests=dict(state.requests),
            parked=dict(state.parked),
            parked_revisions=dict(state.parked_revisions),
            spec=state.spec,
        )

    def apply(self, event: WatchEvent) -> set[int]:
        """Mirror one change; the partitions whose assignment or claim it concerns."""
        value = event.value
        match event.kind:
            case "member":
                _put(self.members, event.name, value if isinstance(value, Member) else None)
                return self._sort_claims()
            case "assignment":
                owner = value.owner if isinstance(value, Assignment) else None
                _put(self.assignment, event.partition, owner)
                return {event.partition}
            case "claim":
                if event.revision <= self.claim_writes.get(event.partition, 0):
                    return set()  # older than our own claim or release
                p, claim = event.partition, value if isinstance(value, Claim) else None
                forged = claim is not None and p in forged_claims(self.members, {p: claim})
                _put(self.forged, p, claim if forged else None)
                _put(self.claims, p, None if forged else claim)
                _put(self.claim_revisions, p, event.revision if claim else None)
                return {p}
            case "standby":
                member = value.member if isinstance(value, Standby) else None
                _put(self.standbys, event.partition, member)
                return {event.partition}
            case "leader":
                if isinstance(value, Candidate):
                    self.candidates[event.name] = event.created
                else:
                    self.candidates.pop(event.name, None)
            case "request":
                request = value if isinstance(value, Rebalance | Move | Drain | Pause) else None
                before = self.requests.get(event.name)
                _put(self.requests, event.name, request)
                return _paused_partitions(before, request, self.spec)
            case "parked":
                record = value if isinstance(value, Parked) else None
                _put(self.parked, event.name, record)
                _put(self.parked_revisions, event.name, event.revision if record else None)
            case "spec":
                self.spec = value if isinstance(value, StreamSpec) else None
        return set()

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
