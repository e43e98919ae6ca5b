"""Hot standby: when may the waiting consumer of a partition take it over? (pure)

A member named the standby of partition p (``standby/<p>``, by a leader run with
``--standby``) subscribes to p's single-active-consumer queue while p's owner consumes it,
and so waits behind it. RabbitMQ activates the standby once the owner's consumer is gone:
its connection died (kill -9, a crash, a network cut), or the owner cancelled. Only the
first may be taken over: a planned cancel always follows a change in etcd (the
assignment moved, the member announced or began its stop, a pause, the claim was
released), and the standby reads etcd after the broker activated it, so it sees that
change. What it requires, all in one consistent read: p's claim is its owner's, on its
lease, that owner is a member and not leaving, p is not paused, and either p is still
assigned to that owner with us as its standby, or the leader has given p to us because
the owner already lost another partition to a takeover (a suspect: its connection died).
Then it takes the claim over (a transaction on the claim's revision) and consumes at
once, its first deliveries being the dead owner's unacked messages, redelivered first.
Otherwise it gives every delivery back, in order, and cancels.

And the claim must be that of the owner it stood behind (``behind``). A standby stands by
behind one owner's consumer; while a partition moves (a graceful leave, a rebalance) its
claim passes to the next owner, and the old consumer's cancel, or its connection's end,
may activate the standby before it stood down. It then sees a consistent group: the new
owner, live, holds the claim, assigned to it, with us its standby again. Taking that over
took a partition from a live member and made it a suspect, so every partition of it moved
away and, a lease TTL later, back (seen: 14-15 partitions moved on a leave instead of 4).

Whether to stand by at all (:func:`wanted`): while the leader names us and the owner
holds the claim, marked live (its consumer is subscribed: ``Group.mark_live``), from IDLE.
(Seen on RabbitMQ 3.10 before the mark: a standby named for a partition just handed to a
new owner subscribed behind the last owner's consumer, whose cancel then activated it,
and it took the partition from the live new owner.) And, once standing, on through the
leader giving the partition to us from an owner whose connection died (a suspect: it
lost another partition to a takeover) while that owner's claim lasts: RabbitMQ activates
us when it notices the same death, and we take it over instead of waiting out the dead
owner's lease. (Seen: the assignment reached us before the activation did, we stood
down, and the partition waited
10 s for the lease.) The phases themselves are ``partq.consumers.state.handoff``'s.

Threads. None of its own, and no state: both functions run on the daemon's controller
thread (``partq.consumers.control.partitions``), :func:`may_take_over` on a group snapshot that
thread
read itself after the broker's activation reached it as a queued ``Standby`` event.
"""

from __future__ import annotations

from partq.consumers.state.handoff import Phase, Standby, State
from partq.coordinator.leader.policy import paused, suspects
from partq.coordinator.store.group import GroupState
from partq.coordinator.store.mirror import GroupMirror

__all__ = ["may_take_over", "wanted"]


def wanted(view: GroupMirror, partition: int, me: str, state: State) -> bool:
    """Whether member ``me`` should stand by for ``partition`` (the module docstring),
    given its handoff ``state`` there; the caller adds whether it can (not leaving, joined)."""
    owner = view.assignment.get(partition)
    claim = view.claims.get(partition)
    if claim is None:
        return False
    named = (
        state.phase is Phase.IDLE
        and view.standbys.get(partition) == me
        and owner not in (None, me)
        and claim.member == owner
        and claim.live
    )
    return named or (
        state.standby is Standby.STANDING
        and owner == me
        and claim.member != me
        and claim.member in suspects(view.claims)
    )


def may_take_over(state: GroupState, partition: int, me: str, behind: str) -> int | None:
    """The claim revision to take ``partition`` over from, or None (give it back).
    ``behind``: the owner whose consumer our standby subscription waited behind."""
    claim = state.claims.get(partition)
    if claim is None or claim.member == me or claim.member != behind or not claim.live:
        return None
    owner = state.members.get(claim.member)
    if owner is None or owner.leaving or claim.lease != owner.lease:
        return None
    if paused(state.requests, partition):
        return None
    assigned = state.assignment.get(partition)
    standing = assigned == claim.member and state.standbys.get(partition) == me
    # the leader already gave it to us: its owner lost another partition to a takeover
    reassigned = assigned == me and claim.member in suspects(state.claims)
    return state.claim_revisions.get(partition) if standing or reassigned else None
