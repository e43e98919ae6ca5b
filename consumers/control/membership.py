"""This member's place in its stream's group: its session, the group watch, joining and leaving.

Threads. :class:`Membership` belongs to the daemon's controller thread
(``partq.consumers.control.daemon``),
which calls every method. The session's keepalive thread reports a lost lease, and the
watch stream's thread each change or failure, only as events put on the controller's queue
(``LeaseLost``, ``WatchEvent``, ``WatchFailed``). :meth:`join` waits (sleeps) while etcd is
down: the controller does nothing else until the member is back.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from partq.consumers import metrics
from partq.consumers.control.config import ConsumerConfig
from partq.consumers.control.events import ControllerEvent
from partq.consumers.control.partitions import Partitions
from partq.coordinator import metrics as metrics_store
from partq.coordinator.store.events import LeaseLost, WatchFailed
from partq.coordinator.store.group import Group, GroupState, Member, WatchEvent
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel.backoff import Backoff
from partq.kernel.errors import EtcdUnavailable, StreamNotFound

__all__ = ["NO_LEADER_WARNING", "Membership"]

log = logging.getLogger("partq.consumer")

_BACKOFF = Backoff()  # joining: 0.2 s doubling to 5 s

# Seconds after joining before a member with no coordinator leading its stream says so:
# nothing is ever assigned without one, and a new user would otherwise wait in silence.
NO_LEADER_WARNING = 5.0


class Membership:
    """One member's session and group watch (the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        group: Group,
        config: ConsumerConfig,
        partitions: Partitions,
        put: Callable[[ControllerEvent], None],
    ) -> None:
        self.registry = registry
        self.group = group
        self.config = config
        self.member = config.member
        self.partitions = partitions
        self.put = put
        self.session: Session | None = None
        self.watch_id: int | None = None
        self.leaderless = False  # said that no coordinator leads: say so when one does
        self._labels = (config.stream, config.member)

    def join(self) -> Session:
        """New session, register the member (retrying while etcd is down)."""
        delays = _BACKOFF.delays()
        while True:
            try:
                lease: list[int] = []  # this try's session's, once made (a later try's own)

                def lost(lease: list[int] = lease) -> None:
                    self.put(LeaseLost(lease[0] if lease else 0))

                session = Session(
                    self.registry.client,
                    self.registry.where,
                    self.config.ttl,
                    on_lost=lost,
                    on_renewal_failure=metrics.LEASE_RENEWAL_FAILURES.labels(*self._labels).inc,
                )
                lease.append(session.id)
                self.session = session
                self.group.join(
                    session,
                    self.member,
                    self.config.weight,
                    self.config.version,
                    priority=self.partitions.priority,
                )
                break
            except EtcdUnavailable as e:
                wait = delays.next()
                log.warning("cannot join %s: %s; retrying in %.1fs", self.config.stream, e, wait)
                time.sleep(wait)
        log.info("joined %s as %s (lease %x)", self.config.stream, self.member, session.id)
        self.partitions.session = session
        return session

    def read_spec(self) -> StreamSpec | None:
        """The stream's spec in etcd now, None if it is gone; raises EtcdUnavailable."""
        try:
            return self.registry.read_spec(self.config.stream)
        except StreamNotFound:
            return None

    def watch(self) -> GroupState:
        """The group now, watched from there on (any earlier watch cancelled); raises
        EtcdUnavailable."""
        self.unwatch()
        state = self.group.snapshot()
        self.watch_id = self.group.watch(
            state.revision,
            lambda e: self.put(WatchFailed(e) if isinstance(e, Exception) else e),
        )
        return state

    def unwatch(self) -> None:
        if self.watch_id is not None:
            self.group.cancel_watch(self.watch_id)
            self.watch_id = None

    def end(self, *, revoke: bool, forget: bool = True) -> None:
        """Close the session (``revoke``: our member key and claims go at once); ``forget``
        it too (not while fenced: a rejoin replaces it)."""
        if self.session is not None:
            self.session.close(revoke=revoke)
        if forget:
            self.session = self.partitions.session = None

    def check_leader(self, lease: int, *, quiet: bool = False) -> None:
        """Warn, once per join (the session ``lease``), when no coordinator leads the stream;
        ``quiet``: not now (stopping, or the stream is gone)."""
        session = self.session
        if quiet or session is None or session.id != lease or self.partitions.mirror.candidates:
            return
        self.leaderless = True
        log.warning(
            "no coordinator leads stream %s (%gs after joining): nothing is assigned until "
            "one runs; start one with `partq coordinator %s`",
            self.config.stream,
            NO_LEADER_WARNING,
            self.config.stream,
        )

    def saw(self, event: WatchEvent) -> None:
        """A watched change: a coordinator leads again (``leader_seen``), and our member
        key stays ours (``_keep_own``)."""
        self.leader_seen()
        changed = event.value is not None or event.malformed is not None  # not deleted
        if event.kind == "member" and event.name == self.member and changed:
            self._keep_own(event.value, event.malformed)

    def _keep_own(self, value: object, malformed: str | None) -> None:
        """Our member key as another identity left it (malformed, or not our weight or
        process): ours is put back, logged and counted. etcd 3.4 lets a role put on any
        lease inside a transaction, and the leader would plan by that value."""
        session = self.session
        if session is None:
            return
        if isinstance(value, Member) and (value.weight, value.pid) == (
            self.config.weight,
            os.getpid(),
        ):
            return
        log.warning(
            "our member key was changed by another identity (%s): putting ours back",
            malformed or f"weight {getattr(value, 'weight', '?')}",
        )
        metrics_store.FORGED_REMOVED.labels(self.config.stream, "member").inc()
        leaving = isinstance(value, Member) and value.leaving
        try:
            self.group.restore_member(
                session,
                self.member,
                self.config.weight,
                self.config.version,
                priority=self.partitions.priority,
                leaving=leaving,
            )
        except EtcdUnavailable as e:
            log.warning("cannot put our member key back yet: %s", e)

    def leader_seen(self) -> None:
        if self.leaderless and self.partitions.mirror.candidates:
            self.leaderless = False
            log.info("a coordinator now runs for stream %s", self.config.stream)

    def announce(self) -> bool:
        """Mark us ``leaving`` if a leader and another member can take our partitions."""
        mirror = self.partitions.mirror
        me = mirror.members.get(self.member)
        others = [m for m in mirror.members.values() if m.id != self.member and not m.leaving]
        owned = self.partitions.owned()
        if not self.config.announce_leave or self.session is None or me is None:
            return False
        if not others or not mirror.candidates or not owned:
            return False
        try:
            announced = self.group.announce_leaving(me, self.session)
        except EtcdUnavailable as e:
            log.warning("cannot announce the stop in etcd: %s; leaving at once", e)
            return False
        if announced:
            log.info(
                "stopping: announced; handing %d partitions over while consuming them", len(owned)
            )
        return announced

    def leave(self) -> None:
        """Delete our member key (the leader moves our partitions away)."""
        if self.session is not None:
            try:
                self.group.leave(self.member, self.session)
            except EtcdUnavailable as e:
                log.warning("cannot leave the group in etcd: %s", e)
