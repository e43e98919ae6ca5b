"""Our claims in etcd: claim, release or hand over, mark live, seal; whose a claim is.

:class:`Claims` carries out the handoff machine's etcd commands for
:class:`partq.consumers.control.partitions.Partitions` and mirrors each write of ours at
once (the watch echoes it later): ``claim`` (``Command.CLAIM``), ``release``
(``Command.RELEASE``: handed straight to the partition's live next owner when it has no
hot standby, ``Group.hand_over``, else deleted), ``mark_live`` (our consumer is
subscribed: a hot standby may stand behind it), ``seal`` (before a cancel when handing
over by priority: an heir activated by the cancel cannot take the claim over). Each
outcome the state machine must hear comes back as events, stepped by the caller.
Takeovers are :mod:`partq.consumers.control.takeovers`'.

Threads. None of its own: every method runs on the daemon's controller thread, which
owns the ``Partitions`` it reads (its mirror, session and slots) and writes through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from partq.consumers.state.handoff import Event, Holder
from partq.coordinator import metrics
from partq.coordinator.store.group import Claim, Member, WatchEvent
from partq.coordinator.store.session import Session

from partq.kernel.errors import EtcdPermissionDenied, EtcdUnavailable

if TYPE_CHECKING:
    from partq.consumers.control.partitions import Partitions

__all__ = ["Claims"]

log = logging.getLogger("partq.consumer")


class Claims:
    """Our claims, for ``partitions`` (the module docstring). ``retry_release(p)``: try
    releasing p again later; ``resync()``: read the group again later."""

    def __init__(
        self,
        partitions: Partitions,
        retry_release: Callable[[int], None],
        resync: Callable[[], None],
    ) -> None:
        self._p = partitions
        self._retry_release = retry_release
        self._resync = resync

    def holder(self, partition: int) -> Holder:
        """Whose ``partition``'s claim is, as the mirror has it."""
        claim = self._p.mirror.claims.get(partition)
        if claim is None:
            return Holder.NOBODY
        session = self._p.session
        return Holder.ME if session and claim.lease == session.id else Holder.OTHER

    def disowned(self, event: WatchEvent) -> bool:
        """Whether ``event`` puts a claim on our lease that we did not write and that no
        previous owner handed us: a takeover (only a standby writes its own), or one for a
        partition not assigned to us. etcd 3.4 lets any role put on any lease inside a
        transaction, so such a claim can come from another member's credentials; it would
        keep the partition from its owner and its standby. Deleted (if it is still on our
        lease), logged and counted, and never taken for a grant."""
        p = self._p
        claim, session = event.value, p.session
        if not isinstance(claim, Claim) or session is None or claim.lease != session.id:
            return False
        partition = event.partition
        if event.revision <= p.mirror.claim_writes.get(partition, 0):
            return False  # our own write's echo
        ours = p.mirror.assignment.get(partition) == p.member == claim.member
        if ours and not claim.takeover:
            return False  # a hand-over to us
        log.warning(
            "partition %d: deleting a claim on our lease that we did not write (%s, naming "
            "%s): written with another identity's credentials",
            partition,
            f"a takeover from {claim.taken_from}" if claim.takeover else "not assigned to us",
            claim.member,
        )
        metrics.FORGED_REMOVED.labels(p.spec.scope, "claim").inc()
        try:
            p.group.release(partition, session)
        except EtcdUnavailable as e:  # then a resync reads it again: released as granted
            log.warning("partition %d: cannot delete it yet: %s", partition, e)
            self._resync()
        return True

    def claim(self, partition: int) -> Event:
        p = self._p
        session = p.session
        assert session is not None
        try:
            revision = p.group.claim(partition, p.member, session)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot claim: %s", partition, e)
            self._resync()
            return Event.CLAIM_REFUSED
        if revision <= 0:
            return Event.CLAIM_REFUSED
        # mirror our own write now: the watch echoes it later
        p.mirror.wrote_claim(partition, Claim(p.member, session.id), revision)
        return Event.CLAIMED

    def release(self, partition: int) -> list[Event]:
        """Release the claim, or hand it to the partition's next owner; nothing if etcd
        cannot be reached (retried later)."""
        p = self._p
        p.slots[partition].retire()
        session = p.session
        assert session is not None
        heir = self._heir(partition)
        try:
            handed = self._hand_over(partition, session, heir) if heir else 0
            revision = handed or p.group.release(partition, session)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot release the claim yet: %s", partition, e)
            self._retry_release(partition)
            return []
        if handed and heir:  # mirror our own write now, as for a claim
            p.mirror.wrote_claim(partition, Claim(heir.id, heir.lease), revision)
            log.debug("partition %d: claim handed over to %s", partition, heir.id)
            return [Event.RELEASED, Event.CLAIM_OTHER]
        if revision > 0:
            p.mirror.wrote_claim(partition, None, revision)
        return [Event.RELEASED]

    def _hand_over(self, partition: int, session: Session, heir: Member) -> int:
        """Hand the claim to ``heir``, or 0 if our etcd role may not put on its lease (etcd
        3.4 does not check a transaction's lease puts; a version that did would refuse it
        to a ``--member`` role every time): then we release it instead."""
        try:
            return self._p.group.hand_over(partition, session, heir)
        except EtcdPermissionDenied as e:
            log.warning("partition %d: cannot hand the claim to %s: %s", partition, heir.id, e)
            return 0

    def _heir(self, partition: int) -> Member | None:
        """The live member the partition is assigned to, if not us: our claim goes straight
        to it (``Group.hand_over``), so it need not claim once the claim is free.

        None while the partition has a hot standby: a standby reads a live owner's claim
        when RabbitMQ activates it as a dying owner's, and the heir's claim would be there
        the moment our cancel could activate it; a deleted claim tells it to give back."""
        mirror = self._p.mirror
        if mirror.standbys.get(partition):
            return None
        owner = mirror.assignment.get(partition)
        member = mirror.members.get(owner) if owner and owner != self._p.member else None
        if member is None or member.leaving or member.lease == 0:
            return None
        return member

    def mark_live(self, partition: int) -> None:
        """Our consumer of ``partition`` is subscribed: say so in our claim, so its hot
        standby stands behind it (``Group.mark_live``). Not marked (etcd unreachable), the
        partition has no standby until it is next acquired."""
        p = self._p
        claim = p.mirror.claims.get(partition)
        session = p.session
        if claim is None or claim.live or session is None or claim.lease != session.id:
            return
        try:
            revision = p.group.mark_live(partition, session, claim)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot mark the claim live: %s", partition, e)
            return
        if revision > 0:
            p.mirror.wrote_claim(partition, replace(claim, live=True), revision)

    def seal(self, partition: int) -> bool:
        """Before a cancel, when handing over by priority: seal our claim, so that an heir
        the cancel may activate (it waits above us at the broker) cannot take it over while
        we still handle what we hold. False if etcd cannot be reached: then we fence (the
        connection is aborted, what we held comes back first, in order) instead."""
        p = self._p
        claim = p.mirror.claims.get(partition)
        session = p.session
        if not p.priority or claim is None or claim.sealed or session is None:
            return True
        if self.holder(partition) is not Holder.ME:
            return True  # not ours any more: nobody can take it over from us
        try:
            revision = p.group.seal(partition, session, claim)
        except EtcdUnavailable as e:
            log.warning(
                "partition %d: cannot seal the claim before a drain (%s): fencing", partition, e
            )
            p.drop()
            self._resync()
            return False
        if revision > 0:
            p.mirror.wrote_claim(partition, replace(claim, sealed=True), revision)
        return True
