"""The leader deletes what partq never writes but a consumer's credentials can.

etcd grants by key prefix, and every consumer may write ``claims/`` and ``parked/`` (any
member may be given any partition). Keys written there outside partq would
stop or divert a partition of another member, and a leader candidate key (etcd 3.4 checks
no lease in a transaction) would stop the coordination of the whole stream:

- a leader candidate key not on the lease its name gives (none, or another):
  :func:`partq.coordinator.store.codec.decode_candidate` makes it malformed, so it never
  leads; nor does one on a lease that holds a member key (a consumer's:
  ``GroupKeys.foreign_candidates``); the leader deletes both (:func:`remove_candidates`),
  naming each;

- a claim not on its member's lease (:func:`partq.coordinator.leader.policy.forged_claims`): on no
  lease it would never go; every reader already ignores it;
- a claim on a lease that holds no live member key
(:func:`partq.coordinator.leader.policy.unbound_claims`),
  as a departed member's claims are while it drains: honoured for a grace period (longer
  than a drain), then deleted, so a lease its writer keeps alive stops a partition no longer;
- a parked record its partition's holder did not write
  (:func:`partq.coordinator.leader.policy.parked_by_holder`, judged on the claim and the member *as
  they
  were* at the record's revision, read from etcd's history): it would divert the key's
  messages to its parking queue; consumers ignore one that arrives while they watch.

Each deletion compares the key's revision (a key rewritten since is judged again) and the
leader's candidate key (fenced like every other leader write, in
:meth:`partq.coordinator.store.group.Group.remove_claim` and ``remove_parked``); each is logged at
warning
and counted in ``partq_forged_removed_total{stream,kind}``. A deletion etcd refuses (a
leader's role without delete rights there) is logged once per key and revision and tried
again only after :attr:`Refusals.RETRY` seconds (:class:`Refusals`), not on every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from partq.coordinator import metrics
from partq.coordinator.leader import policy
from partq.coordinator.store.election import Fence
from partq.coordinator.store.group import Claim, Group
from partq.coordinator.store.mirror import GroupMirror
from partq.producer.contract import StreamSpec

from partq.kernel import keys
from partq.kernel.errors import EtcdCompacted, EtcdPermissionDenied, EtcdUnavailable

__all__ = ["Refusals", "remove_candidates", "remove_claims", "remove_parked", "remove_unbound"]

log = logging.getLogger("partq.coordinator")


class Refusals:
    """The forged keys etcd refused to let the leader delete, by (kind, name): the revision
    refused and when to try again. Owned by the coordinator's thread; cleared when it stops
    leading."""

    RETRY = 60.0  # seconds before a refused deletion is tried again (unless the key changed)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._refused: dict[tuple[str, str], tuple[int, float]] = {}

    def waiting(self, kind: str, name: str, revision: int) -> bool:
        """Whether the deletion of this key at ``revision`` was refused less than
        :attr:`RETRY` seconds ago."""
        found = self._refused.get((kind, name))
        return found is not None and found[0] == revision and self._clock() < found[1]

    def refused(self, kind: str, name: str, revision: int) -> bool:
        """Note a refusal; whether it is the first for this key at this revision (the one
        to log)."""
        first = self._refused.get((kind, name), (None, 0.0))[0] != revision
        self._refused[(kind, name)] = (revision, self._clock() + self.RETRY)
        return first

    def clear(self) -> None:
        self._refused.clear()


def _delete(
    group: Group, fence: Fence, refusals: Refusals, kind: str, name: str, revision: int
) -> bool:
    """Delete the forged key of ``kind`` (claim or parked) called ``name`` if it is still at
    ``revision`` and we lead: whether it is gone. A role without delete rights there is
    refused: logged once, tried again after :attr:`Refusals.RETRY` seconds, and the leader
    goes on leading."""
    if refusals.waiting(kind, name, revision):
        return False
    try:
        if kind == "claim":
            return group.remove_claim(fence, int(name), revision)
        if kind == "leader":
            return group.remove_candidate(fence, name, revision)
        return group.remove_parked(fence, name, revision)
    except EtcdPermissionDenied as e:
        if refusals.refused(kind, name, revision):
            log.warning(
                "%s: cannot delete the forged %s key %s (trying again every %.0f s): %s",
                group.stream,
                kind,
                name,
                Refusals.RETRY,
                e,
            )
        return False


def _delete_claim(
    group: Group,
    fence: Fence,
    refusals: Refusals,
    mirror: GroupMirror,
    p: int,
    claim: Claim,
    why: str,
) -> None:
    """Delete the claim on ``p`` as mirrored (in ``forged`` or ``claims``), logged with
    ``why`` and counted."""
    revision = mirror.claim_revisions.get(p, 0)
    if not _delete(group, fence, refusals, "claim", f"{p:05d}", revision):
        return  # changed since (the watch brings it), refused, or we no longer lead
    (mirror.forged if p in mirror.forged else mirror.claims).pop(p, None)
    mirror.claim_revisions.pop(p, None)
    metrics.FORGED_REMOVED.labels(group.stream, "claim").inc()
    log.warning(
        "%s: deleted the claim on partition %d naming %s on %s: %s",
        group.stream,
        p,
        claim.member,
        f"lease {claim.lease:x}" if claim.lease else "no lease",
        why,
    )


def remove_claims(group: Group, fence: Fence, refusals: Refusals, mirror: GroupMirror) -> None:
    """Delete every claim the mirror holds apart as forged."""
    for p, claim in sorted(mirror.forged.items()):
        why = "not on its member's lease, so written outside partq with a consumer's credentials"
        _delete_claim(group, fence, refusals, mirror, p, claim, why)


def remove_candidates(
    group: Group, fence: Fence, refusals: Refusals, forged: dict[str, int]
) -> None:
    """Delete the leader candidate keys in ``forged`` (name -> revision; each deleted one
    taken out): not on the lease their name gives, so put outside partq. None of them
    leads (:func:`partq.coordinator.store.codec.decode_candidate`), but on no lease one
    would stay for ever, and the operator would not know why."""
    for name, revision in sorted(forged.items()):
        if not _delete(group, fence, refusals, "leader", name, revision):
            continue  # changed since (the watch brings it), refused, or we no longer lead
        del forged[name]
        metrics.FORGED_REMOVED.labels(group.stream, "leader").inc()
        log.warning(
            "%s: deleted the leader candidate key %s%s: not on a lease of its own (on none, "
            "on another than its name gives, or on a consumer's), so written outside partq "
            "with some identity's credentials; it never led",
            group.stream,
            keys.leader_prefix(group.stream),
            name,
        )


def remove_unbound(
    group: Group,
    fence: Fence,
    refusals: Refusals,
    mirror: GroupMirror,
    seen: dict[int, tuple[int, float]],
    now: float,
    grace: float,
) -> None:
    """Delete the claims unbound for ``grace`` seconds. ``seen``: each unbound claim's
    (revision, deadline), kept up to date here (the caller wakes up at the first deadline)."""
    unbound = policy.unbound_claims(mirror.members, mirror.claims)
    for p in [p for p in seen if p not in unbound]:
        del seen[p]
    for p, claim in unbound.items():
        revision = mirror.claim_revisions.get(p, 0)
        if seen.get(p, (None, 0.0))[0] != revision:
            seen[p] = (revision, now + grace)
        if now < seen[p][1]:
            continue
        del seen[p]
        why = f"no live member holds that lease, and it outlived the grace of {grace:.0f} s"
        _delete_claim(group, fence, refusals, mirror, p, claim, why)


def remove_parked(
    group: Group,
    fence: Fence,
    refusals: Refusals,
    mirror: GroupMirror,
    unverified: dict[str, int],
    spec: StreamSpec,
) -> None:
    """Judge each record in ``unverified`` (key id -> revision; emptied) and delete those
    their partition's holder did not write. A record whose revision etcd compacted away
    cannot be judged: it stays (logged); one that cannot be read now is judged next time."""
    for name, revision in sorted(unverified.items()):
        del unverified[name]  # put back below if etcd cannot say now
        record = mirror.parked.get(name)
        if record is None or mirror.parked_revisions.get(name) != revision:
            continue  # gone or rewritten since: its own event brought it back here
        try:
            claim, member, then = group.parked_at(record, revision)
        except EtcdUnavailable:
            unverified[name] = revision  # etcd away: judged on the leader's next step
            continue
        except EtcdCompacted as e:
            log.warning(
                "%s: cannot check who parked key %s (revision %d): %s; keeping it",
                group.stream,
                record.key_text,
                revision,
                e,
            )
            continue
        # by the layout the key was parked under: a resize since may have moved the key
        partitions = then.partitions if then is not None else spec.partitions
        if policy.parked_by_holder(record, partitions, claim, member):
            continue
        if not _delete(group, fence, refusals, "parked", name, revision):
            continue
        metrics.FORGED_REMOVED.labels(group.stream, "parked").inc()
        log.warning(
            "%s: deleted the parked record of key %s (partition %d, naming %s): not written by "
            "the partition's holder, so written outside partq with a consumer's credentials",
            group.stream,
            record.key_text,
            record.partition,
            record.member,
        )
