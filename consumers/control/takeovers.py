"""Standby subscriptions and the takeovers they lead to, on one consumer.

:class:`Standbys` decides, for :class:`partq.consumers.control.partitions.Partitions`,
when to stand by for a partition and when to stand down: as its hot standby
(:func:`partq.consumers.state.standby.wanted`, behind an owner that may die) or as its
heir (``partq.consumers.state.priority``: subscribed above a live owner that yields to
us). It carries out the standby commands of the handoff machine (``STAND_BY``,
``STAND_DOWN``, ``GIVE_BACK``, ``PROMOTE``), and decides each activated standby: take
the partition over, or give back.

Every takeover goes through one method, :meth:`Standbys.take_over` (the only caller of
``Group.take_over``): a dead owner's claim taken by its hot standby, a live owner's by
its heir once the broker switched to it (retried over the owner's rewrites that seal
nothing), and the rewrite that makes a takeover claim ordinary a lease TTL later
(:meth:`Standbys.settle`). An activated standby's decision is made in one place,
:meth:`Standbys.check` (``_decide``), after one read of the group for them all.

Threads. None of its own: every method runs on the daemon's controller thread, which
owns the ``Partitions`` it reads (mirror, session, slots) and steps through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from partq.consumers import metrics
from partq.consumers.control.slot import Behind
from partq.consumers.state import priority, standby
from partq.consumers.state.handoff import Command, Event, Phase, Standby
from partq.coordinator.leader import policy
from partq.coordinator.store.group import Claim, GroupState
from partq.coordinator.store.session import Session

from partq.kernel.errors import EtcdUnavailable

if TYPE_CHECKING:
    from partq.consumers.control.partitions import Partitions

__all__ = ["Standbys"]

log = logging.getLogger("partq.consumer")

# How many of the owner's rewrites that seal nothing an heir's takeover follows (a live mark,
# a takeover made ordinary: at most two in a claim's life) before it gives back.
_REWRITES = 3


class Standbys:
    """Our standby subscriptions and takeovers, for ``partitions`` (the module docstring).
    ``settle_later(p)``: call :meth:`settle` for p a lease TTL later."""

    def __init__(self, partitions: Partitions, settle_later: Callable[[int], None]) -> None:
        self._p = partitions
        self._settle_later = settle_later

    # -- standing by ---------------------------------------------------------------------

    def inherits(self, partition: int) -> bool:
        """Whether we should subscribe to ``partition`` as its heir, above its owner's
        priority: assigned to us, waiting for an unsealed claim of a live member that hands
        over by priority too (so it yields, and seals its claim before any cancel)."""
        p = self._p
        state = p.slots[partition].state
        claim = p.mirror.claims.get(partition)
        holder = p.mirror.members.get(claim.member) if claim is not None else None
        return (
            p.priority
            and state.phase is Phase.WAITING
            and state.assigned
            and claim is not None
            and not claim.sealed
            and claim.priority < priority.MAX_PRIORITY
            and holder is not None
            and holder.priority
            and holder.lease == claim.lease
            and not policy.paused(p.mirror.requests, partition)
        )

    def sync(self, partition: int) -> None:
        """Stand by for ``partition``, or stand down, as
        :func:`partq.consumers.state.standby.wanted` says, or as its heir (:meth:`inherits`),
        while we can (joined, not leaving).

        An heir subscription stays while the claim is the one it subscribed behind, even if
        the partition is no longer assigned to us (a leader's flapping assignment): the
        broker may have switched to it already, and the takeover is then ours to make
        (``priority.inherits_claim``); a give-back of an active consumer is not in order if a
        delivery is in flight to it when its cancel is applied. A standby behind an owner
        that no longer holds the claim (a move by priority does not activate standbys: the
        broker switches to the heir) stands down, and stands by again if still wanted."""
        p = self._p
        slot = p.slots[partition]
        usable = not p.leaving and p.session is not None
        claim = p.mirror.claims.get(partition)
        behind = slot.behind
        if behind.heir and slot.state.standby is Standby.STANDING:
            if (
                usable
                and claim is not None
                and priority.inherits_claim(
                    claim, p.mirror.claim_revisions.get(partition), behind.owner, behind.seen
                )
            ):
                return
            p.feed(partition, Event.STANDBY_UNWANTED)
        heir = usable and self.inherits(partition)
        want = heir or (usable and standby.wanted(p.mirror, partition, p.member, slot.state))
        if slot.state.standby is Standby.STANDING:  # a hot standby's
            owner = slot.behind.owner
            # by priority only: a drain's cancel activates the standby, which gives back and
            # stands by again behind the new owner (partq.consumers.state.standby)
            moved = p.priority and claim is not None and owner not in ("", claim.member)
            # given the partition of a dead owner we stand behind (a suspect): RabbitMQ
            # activates us as it notices the death, and we take over; an heir subscription
            # instead would first stand us down, giving back what we may have been sent
            kept = (
                want
                and claim is not None
                and claim.member == owner
                and claim.member in policy.suspects(p.mirror.claims)
            )
            if not want or (heir and not kept) or moved:
                p.feed(partition, Event.STANDBY_UNWANTED)
        if want and slot.state.standby is Standby.NONE:
            p.feed(partition, Event.STANDBY_WANTED)

    def do(self, partition: int, command: Command) -> list[Event]:
        """Carry out a command of the hot standby's phases (``partq.consumers.state.handoff``),
        an heir's included (a standby subscribed above the owner:
        ``partq.consumers.state.priority``); the events that follow."""
        p = self._p
        match command:
            case Command.STAND_BY:
                claim = p.mirror.claims.get(partition)
                heir = claim is not None and self.inherits(partition)
                rank = priority.heir_priority(claim.priority) if heir and claim else None
                if not p.broker.stand_by(partition, rank):
                    return [Event.STANDBY_LOST]  # no connection: not standing
                if claim is None:
                    p.slots[partition].stands_behind(Behind())
                elif heir and rank is not None:
                    seen = p.mirror.claim_revisions.get(partition, 0)
                    behind = Behind(claim.member, claim.lease, seen, rank)
                    p.slots[partition].stands_behind(behind)
                    log.info(
                        "partition %d: subscribed above %s (priority %d): its heir",
                        partition,
                        claim.member,
                        rank,
                    )
                    return []
                else:
                    p.slots[partition].stands_behind(Behind(claim.member))
                owner = p.mirror.assignment.get(partition)
                log.info("partition %d: standing by behind %s", partition, owner)
            case Command.STAND_DOWN:
                p.broker.stand_down(partition)
            case Command.GIVE_BACK:
                # an activation we may not take over (refused, stood down, or the
                # partition ours on another subscription): not always a planned move's
                log.info(
                    "partition %d: giving our activated standby subscription back, in order",
                    partition,
                )
                p.broker.give_back(partition)
            case Command.PROMOTE:  # the worker first: the standby's deliveries go to it
                worker = p.hire(partition)
                p.broker.promote(partition, worker.generation)
        return []

    def lost(self, partition: int) -> None:
        """The standby's channel or connection went: stand by again if still wanted."""
        p = self._p
        if p.slots[partition].state.standby is not Standby.NONE:
            log.info("partition %d: our standby subscription ended", partition)
        p.feed(partition, Event.STANDBY_LOST)
        self.sync(partition)

    def activated(self, partition: int) -> bool:
        """RabbitMQ activated our standby subscription of ``partition``: pending for
        :meth:`check` if it still stood by (else given back at once); True if it is pending
        and no check was pending yet (queue one)."""
        first = not self.pending()
        log.info("partition %d: RabbitMQ activated our standby subscription", partition)
        self._p.feed(partition, Event.ACTIVATED)
        return first and self._p.slots[partition].state.standby is Standby.ACTIVATED

    def pending(self) -> list[int]:
        return [p for p, s in self._p.slots.items() if s.state.standby is Standby.ACTIVATED]

    # -- taking over ---------------------------------------------------------------------

    def check(self, *, allowed: bool = True) -> None:
        """Take over, or give back, every standby activated so far, after one read of the
        group: it comes after each activation, so it sees any etcd change that preceded a
        planned cancel (``partq.consumers.state.standby``). A dying owner activates all its
        standbys at once: one read for them all, not one each. Not ``allowed`` (stopping):
        give them all back. An heir's takeover needs no read: its transaction on the
        claim's revision is the whole check (``priority.inherits_claim``)."""
        p = self._p
        pending = self.pending()
        session = p.session if allowed else None
        state: GroupState | None = None
        if session is not None and any(not p.slots[q].behind.heir for q in pending):
            try:
                state = p.group.snapshot()
            except EtcdUnavailable as e:
                log.warning("cannot check the takeovers of %s: %s", pending, e)
        for partition in pending:
            self._decide(partition, state, session)

    def _decide(self, partition: int, state: GroupState | None, session: Session | None) -> None:
        """Take an activated standby's partition over, or give it back: a hot standby's
        from its dead owner (if ``state``, read after the activation, says it may:
        ``standby.may_take_over``), an heir's from the owner that yielded to it (the very
        claim it subscribed behind: :meth:`_inherited`)."""
        p = self._p
        slot = p.slots[partition]
        behind = slot.behind  # read now: the takeover's step forgets it
        owner: str | None = None  # the dead owner taken over from (None: an heir's)
        if behind.heir:
            revision = self._inherited(partition, session, behind)
        else:
            seen = None
            if state is not None and behind.owner:
                seen = standby.may_take_over(state, partition, p.member, behind.owner)
            owner = state.claims[partition].member if state is not None and seen is not None else ""
            revision = self.take_over(partition, session, seen if owner else None, owner) or 0
        if revision <= 0 or session is None:
            p.feed(partition, Event.TAKEOVER_REFUSED)
            return
        if owner is None:
            log.info(
                "partition %d: RabbitMQ switched to us (priority %d): taken over from %s",
                partition,
                behind.rank,
                behind.owner,
            )
            claim = Claim(p.member, session.id, priority=behind.rank, live=True)
        else:
            log.warning(
                "partition %d: its owner %s is gone from RabbitMQ: taken over", partition, owner
            )
            metrics.TAKEOVERS.labels(*p.labels).inc()
            claim = Claim(p.member, session.id, takeover=True, taken_from=owner, live=True)
        slot.taken_over(owner)
        p.mirror.wrote_claim(partition, claim, revision)
        if owner is not None:
            self._settle_later(partition)
        p.feed(partition, Event.TAKEN_OVER)  # PROMOTE: a worker, then promote
        if owner is None:
            p.sync(partition)  # taken over while the partition moved on: yield or drain it

    def _inherited(self, partition: int, session: Session | None, behind: Behind) -> int:
        """Our heir's claim on ``partition`` over the one it subscribed behind; its
        revision, or 0. That claim's holder may have rewritten it since without sealing it
        (marked it live once subscribed, made its takeover claim ordinary): it cancelled
        nothing, so it is still the very claim (``priority.inherits_claim``), taken at its
        new revision. A refusal over such a rewrite would leave the heir given back and the
        owner yielding to it for as long as traffic flows (seen: RabbitMQ 4.0.5, a member
        back from a freeze past its lease)."""
        seen = behind.seen
        for _ in range(_REWRITES):
            revision = self.take_over(partition, session, seen, rank=behind.rank) or 0
            if revision > 0 or session is None:
                return revision
            try:
                claim, current = self._p.group.read_claim(partition)
            except EtcdUnavailable as e:
                log.warning("partition %d: cannot read the claim to take it over: %s", partition, e)
                return 0
            if claim is None or claim.lease != behind.lease or claim.sealed:
                return 0
            if current == seen:
                return 0
            seen = current
        return 0

    def take_over(
        self,
        partition: int,
        session: Session | None,
        seen: int | None,
        owner: str = "",
        rank: int = 0,
    ) -> int | None:
        """The one way to take a claim over (``Group.take_over`` of the claim seen at
        revision ``seen``, None: we may not): its new revision; 0 if refused; None if
        etcd cannot be reached (logged)."""
        if seen is None or session is None:
            return 0
        try:
            return self._p.group.take_over(
                partition, self._p.member, session, seen, owner, priority=rank
            )
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot take the claim over: %s", partition, e)
            return None

    def settle(self, partition: int) -> None:
        """A lease TTL after a takeover: make our takeover claim ordinary (taken over from
        ourselves), so the member we took it from (gone by now if it was dead) may be given
        partitions again. Retried a lease TTL later while etcd cannot be reached."""
        p = self._p
        claim = p.mirror.claims.get(partition)
        session = p.session
        if claim is None or not claim.takeover or session is None or claim.lease != session.id:
            return
        try:
            current, seen = p.group.read_claim(partition)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot settle the takeover yet: %s", partition, e)
            current, seen = claim, None
        if current is None or current.lease != session.id:
            return
        revision = None if seen is None else self.take_over(partition, session, seen)
        if revision is None:
            self._settle_later(partition)
        elif revision > 0:
            p.mirror.wrote_claim(partition, Claim(p.member, session.id, live=True), revision)
