"""The coordinator service: one leader per stream keeps the assignment balanced.

Per stream, a :class:`StreamCoordinator` thread keeps a session (lease), puts an
election candidate key on it, and mirrors the stream's group keys from one
snapshot plus one watch: no polling. The candidate with the lowest create
revision leads. The leader writes the assignment, one key per changed
partition, in transactions fenced on its candidate key's create revision: a
deposed leader's key is gone, so its writes fail.

Rebalance rules: wait for ``min_members`` before the first assignment and for
the member set to stay unchanged for ``settle`` seconds; then step toward
:func:`coordinator.assignor.assign`'s target moving at most ``max_moves``
partitions at once (a partition is *in motion* until its new owner claims it).
In ``manual`` mode only operator requests (rebalance, move, drain) move anything.

Values come decoded from :class:`coordinator.group.Group`; a malformed one is an
absent key (so a garbled assignment is rewritten, a garbled request ignored). A
stream deleted, or whose spec is malformed, makes the coordinator not ready
(:meth:`StreamCoordinator.check`) until it is back; then it campaigns again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from coordinator import codec, metrics
from coordinator.assignor import assign, limit_moves
from coordinator.group import (
    Assignment,
    Candidate,
    Claim,
    Drain,
    Group,
    GroupState,
    Member,
    Move,
    Rebalance,
    Request,
    WatchEvent,
)
from coordinator.session import Session
from kernel import keys, logs
from kernel.errors import (
    EtcdUnavailable,
    MalformedValue,
    NotLeader,
    PartqError,
    StreamNotFound,
    UsageError,
)
from kernel.etcd import etcd_errors
from producer.contract import StreamSpec
from producer.registry import Registry

__all__ = ["CoordinatorConfig", "StreamCoordinator", "plan"]

log = logging.getLogger("partq.coordinator")
_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_BACKOFF, _MAX_BACKOFF = 0.2, 5.0


@dataclass(frozen=True)
class CoordinatorConfig:
    min_members: int = 1
    settle: float = 1.0
    max_moves: int | None = None
    manual: bool = False
    ttl: int = 5


@dataclass
class _Mirror:
    """The leader's view of the stream's keys, kept current by the watch."""

    members: dict[str, Member] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    claims: dict[int, Claim] = field(default_factory=dict)
    leaders: dict[str, int] = field(default_factory=dict)  # candidate key -> create revision
    requests: dict[str, Request] = field(default_factory=dict)

    @classmethod
    def of(cls, state: GroupState) -> _Mirror:
        return cls(
            dict(state.members),
            dict(state.assignment),
            dict(state.claims),
            {key: rev for rev, key in state.leaders},
            dict(state.requests),
        )


def drained(requests: dict[str, Request]) -> set[str]:
    """Members an operator asked to drain."""
    return {r.member for r in requests.values() if isinstance(r, Drain)}


def in_motion(assignment: dict[int, str], claims: dict[int, Claim]) -> set[int]:
    """Partitions whose assigned owner does not hold the claim yet."""
    held = {p: c.member for p, c in claims.items()}
    return {p for p, owner in assignment.items() if held.get(p) != owner}


def plan(
    spec: StreamSpec,
    members: dict[str, Member],
    assignment: dict[int, str],
    claims: dict[int, Claim],
    excluded: set[str],
    max_moves: int | None,
) -> dict[int, str]:
    """The next assignment step: pure, used by the leader and by ``partq rebalance --dry-run``."""
    weights = {m.id: m.weight for m in members.values() if m.id not in excluded}
    if not weights:
        return {}
    current = {p: o for p, o in assignment.items() if o in weights and p < spec.partitions}
    target = assign(spec.partitions, weights, current)
    budget = None
    if max_moves is not None:
        moving = {p for p in in_motion(current, claims) if claims.get(p) is not None}
        budget = max(0, max_moves - len(moving))
    return limit_moves(current, target, budget)


class _Missing(Exception):
    """The stream's spec is gone or unreadable: not ready until it is back."""


class StreamCoordinator(threading.Thread):
    """Campaigns for, and while leading coordinates, one stream, until :meth:`stop`.

    Each campaign is one session, one candidate key, one snapshot and one watch. A
    campaign ends on an error and the next one starts after a backoff (0.2 s doubling
    to 5 s, reset once a campaign got going): etcd away, deposed, or a changed spec
    (logged at warning); the stream missing (deleted, or its spec malformed: logged
    once, :meth:`check` fails until it is back); anything unexpected (logged with its
    traceback, counted in ``partq_coordinator_failures_total``). Only an error in that
    retry loop itself ends the thread: :attr:`failure` holds it, and ``partq
    coordinator`` exits 1.
    """

    def __init__(self, registry: Registry, stream: str, config: CoordinatorConfig) -> None:
        super().__init__(name=f"coordinator-{stream}", daemon=True)
        self.registry = registry
        self.stream = stream
        self.config = config
        self.group = Group(registry.client, registry.where, stream)
        self.events: queue.Queue[WatchEvent | Exception | str] = queue.Queue()
        self.stopping = threading.Event()
        self.leading = threading.Event()
        self.spec: StreamSpec | None = None
        self.missing: str | None = None  # why the stream is missing, while it is
        self.failure: BaseException | None = None  # what ended the thread, if anything did
        self._fence: tuple[str, int] | None = None
        self._mirror = _Mirror()
        self._settle_at: float | None = None
        self._assigned_once = False
        self._going = False  # this campaign reached its event loop
        self._last_error: str | None = None
        self._exported: set[tuple[str, str, str, str]] = set()  # our partq_assignment_info

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        self.events.put("stop")

    def check(self) -> None:
        """Raise (a :class:`PartqError` saying why) unless this stream can be coordinated."""
        if self.failure is not None:
            raise PartqError(f"the coordinator of {self.stream} died: {self.failure!r}")
        if self.missing is not None:
            raise StreamNotFound(f"stream {self.stream} is missing: {self.missing}")

    def run(self) -> None:
        with logs.bind(stream=self.stream):
            try:
                self._run()
            except BaseException as e:  # partq coordinator exits 1 on it
                self.failure = e
                log.critical("%s: the coordinator thread died: %r", self.stream, e, exc_info=True)
            finally:
                self._step_down()

    def _run(self) -> None:
        backoff = _BACKOFF
        while not self.stopping.is_set():
            self._going = False
            try:
                self._campaign()
            except (EtcdUnavailable, NotLeader) as e:  # etcd away, or deposed
                log.warning("%s: %s; campaigning again in %.1fs", self.stream, e, backoff)
            except _Missing as e:
                if self.missing != str(e):
                    log.warning(
                        "%s: the stream is missing (deleted, or its spec is unreadable): %s; "
                        "not ready, waiting for it", self.stream, e,
                    )  # fmt: skip
                self.missing = str(e)
            except Exception as e:
                metrics.FAILURES.labels(self.stream, type(e).__name__).inc()
                error = f"{type(e).__name__}: {e}"
                if error != self._last_error:
                    log.error(
                        "%s: unexpected error; campaigning again in %.1fs", self.stream, backoff,
                        exc_info=True,
                    )  # fmt: skip
                else:
                    log.warning("%s: again %s; retrying in %.1fs", self.stream, error, backoff)
                self._last_error = error
            self._step_down()
            if self._going:
                backoff = _BACKOFF
            if self.stopping.wait(backoff):
                break
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _campaign(self) -> None:
        try:
            self.spec = self.registry.read_spec(self.stream)
        except (StreamNotFound, MalformedValue, UsageError) as e:
            raise _Missing(str(e)) from None
        if self.missing is not None:
            log.info("%s: the stream is back; campaigning", self.stream)
            self.missing = None
        self._drain_events()  # what the previous campaign's watch left is stale
        session = Session(
            self.registry.client, self.registry.where, self.config.ttl,
            on_lost=lambda: self.events.put("lease-lost"),
        )  # fmt: skip
        candidate = keys.leader_candidate(self.stream, session.id)
        watch_id = None
        try:
            with etcd_errors(self.registry.where):
                self.registry.client.put(candidate, codec.encode_candidate(), lease=session.lease)
            state = self.group.snapshot()
            if state.spec is None:  # deleted (or garbled) since we read it
                raise _Missing(f"stream {self.stream!r} was deleted")
            if state.spec != self.spec:
                raise NotLeader(f"{self.stream}: its spec changed to {state.spec}")
            self._mirror = _Mirror.of(state)
            if candidate not in self._mirror.leaders:
                raise NotLeader(f"{self.stream}: our candidate key {candidate} is gone")
            self._fence = (candidate, self._mirror.leaders[candidate])
            watch_id = self.group.watch(state.revision, self.events.put)
            self._settle_at = time.monotonic() + self.config.settle
            self._going = True
            self._last_error = None
            self._loop()
        finally:
            self._step_down()
            if watch_id is not None:
                self.group.cancel_watch(watch_id)
            session.close(revoke=True)

    def _drain_events(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.events.get_nowait()  # a "stop" among them: self.stopping is set

    def _step_down(self) -> None:
        if self.leading.is_set():
            log.info("%s: no longer leading", self.stream)
        self.leading.clear()
        metrics.IS_LEADER.labels(self.stream).set(0)
        self._export_assignment(set())

    # -- the event loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            timeout = None
            if self._settle_at is not None:
                timeout = max(0.0, self._settle_at - time.monotonic())
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                event = "settled"
            if event == "stop":
                return
            if event == "lease-lost" or isinstance(event, Exception):
                raise event if isinstance(event, EtcdUnavailable) else EtcdUnavailable(str(event))
            if isinstance(event, WatchEvent):
                self._apply(event)
            self._update_leadership()
            if self.leading.is_set():
                self._lead(event)
            self._export()

    def _apply(self, event: WatchEvent) -> None:
        """Mirror one change; a malformed value (``event.value`` None) is an absent key."""
        m = self._mirror
        value = event.value
        if event.kind == "member":
            if isinstance(value, Member):
                m.members[event.name] = value
            else:
                m.members.pop(event.name, None)
            self._settle_at = time.monotonic() + self.config.settle
        elif event.kind == "assignment":
            if isinstance(value, Assignment):
                m.assignment[event.partition] = value.owner
            else:
                m.assignment.pop(event.partition, None)
        elif event.kind == "claim":
            if isinstance(value, Claim):
                m.claims[event.partition] = value
            else:
                m.claims.pop(event.partition, None)
        elif event.kind == "leader":
            key = keys.leader_prefix(self.stream) + event.name
            if isinstance(value, Candidate):
                m.leaders.setdefault(key, event.revision)
            else:
                m.leaders.pop(key, None)
                if self._fence is not None and key == self._fence[0]:
                    raise NotLeader(f"{self.stream}: our candidate key {key} is gone")
        elif event.kind == "request":
            if isinstance(value, Rebalance | Move | Drain):
                m.requests[event.name] = value
            else:
                m.requests.pop(event.name, None)
        elif event.kind == "spec":
            if not isinstance(value, StreamSpec):
                why = f"its spec is malformed: {event.malformed}" if event.malformed else ""
                raise _Missing(why or f"stream {self.stream!r} was deleted")
            if value != self.spec:
                raise NotLeader(f"{self.stream}: its spec changed to {value}")

    def _update_leadership(self) -> None:
        assert self._fence is not None
        first = min(self._mirror.leaders.items(), key=lambda kv: kv[1], default=None)
        leading = first is not None and first[0] == self._fence[0]
        if leading and not self.leading.is_set():
            log.info("%s: leading (candidate %s)", self.stream, self._fence[0])
            self.leading.set()
            self._settle_at = time.monotonic() + self.config.settle
        elif not leading and self.leading.is_set():
            self._step_down()
        metrics.IS_LEADER.labels(self.stream).set(1 if leading else 0)

    def _lead(self, event: WatchEvent | Exception | str) -> None:
        m = self._mirror
        for name, request in sorted(m.requests.items()):
            self._handle_request(name, request)
        if self.config.manual:
            return
        settled = self._settle_at is None or time.monotonic() >= self._settle_at
        if not settled:
            return
        self._settle_at = None
        live = {k: v for k, v in m.members.items() if k not in drained(m.requests)}
        if not m.assignment and len(live) < self.config.min_members:
            return
        reason = "startup" if not self._assigned_once else "membership"
        if isinstance(event, WatchEvent) and event.kind == "claim":
            reason = "step"
        self._reconcile(reason)

    def _reconcile(self, reason: str) -> None:
        assert self.spec is not None
        m = self._mirror
        step = plan(
            self.spec, m.members, m.assignment, m.claims, drained(m.requests), self.config.max_moves
        )
        self._write(step, reason)
        self._assigned_once = True

    def _handle_request(self, name: str, request: Request) -> None:
        m = self._mirror
        if isinstance(request, Rebalance):
            self._reconcile("manual")
            self.group.clear_request(name)
        elif isinstance(request, Move):
            partition, to = request.partition, request.to
            if to in m.members and self.spec and 0 <= partition < self.spec.partitions:
                self._write({**m.assignment, partition: to}, "move")
            else:
                log.warning(
                    "%s: ignoring move of %s to unknown member %s", self.stream, partition, to
                )
            self.group.clear_request(name)
        elif isinstance(request, Drain):
            member = request.member
            if member not in m.members:
                self.group.clear_request(name)  # it left: the drain is done
            elif any(owner == member for owner in m.assignment.values()):
                self._reconcile("drain")

    def _write(self, target: dict[int, str], reason: str) -> None:
        """Write the partitions whose owner changes, fenced on our leadership."""
        assert self._fence is not None
        m = self._mirror
        changed = sorted(p for p, owner in target.items() if m.assignment.get(p) != owner)
        if not changed:
            return
        client = self.registry.client
        t = client.transactions
        candidate, revision = self._fence
        for start in range(0, len(changed), _TXN_OPS):
            chunk = changed[start : start + _TXN_OPS]
            puts = [
                t.put(keys.assignment(self.stream, p), codec.encode_assignment(target[p]))
                for p in chunk
            ]
            began = time.monotonic()
            with etcd_errors(self.registry.where):
                ok, _ = client.transaction(
                    compare=[t.create(candidate) == revision], success=puts, failure=[]
                )
            metrics.ETCD_SECONDS.labels("assign").observe(time.monotonic() - began)
            if not ok:
                self._step_down()
                raise NotLeader(f"{self.stream}: lost leadership while writing the assignment")
            for p in chunk:
                m.assignment[p] = target[p]
        moved = sum(1 for p in changed if p in m.claims)
        metrics.REBALANCES.labels(self.stream, reason).inc()
        metrics.PARTITIONS_MOVED.labels(self.stream).inc(moved)
        log.info(
            "%s: assignment %s: %d partitions changed owner", self.stream, reason, len(changed)
        )

    def _export(self) -> None:
        if self.spec is None:
            return
        spec = self.spec
        m = self._mirror
        live = {k for k in m.members}
        owned = {p: o for p, o in m.assignment.items() if o in live and p < spec.partitions}
        metrics.MEMBERS.labels(self.stream).set(len(m.members))
        metrics.PARTITIONS_UNASSIGNED.labels(self.stream).set(spec.partitions - len(owned))
        metrics.PARTITIONS_IN_MOTION.labels(self.stream).set(len(in_motion(owned, m.claims)))
        weights = {k: v.weight for k, v in m.members.items()}
        total = sum(weights.values())
        worst = 0.0
        counts = {k: 0 for k in weights}
        for owner in owned.values():
            counts[owner] += 1
        for member, weight in weights.items():
            worst = max(worst, abs(counts[member] - spec.partitions * weight / total))
        metrics.IMBALANCE.labels(self.stream).set(worst)
        if self.leading.is_set():
            self._export_assignment(
                {(self.stream, str(p), owner, spec.queue(p)) for p, owner in owned.items()}
            )

    def _export_assignment(self, series: set[tuple[str, str, str, str]]) -> None:
        """Make this stream's ``partq_assignment_info`` series exactly ``series`` (other
        streams' series, of other coordinators in this process, are left alone)."""
        for labels in self._exported - series:
            metrics.ASSIGNMENT_INFO.remove(*labels)
        for labels in series - self._exported:
            metrics.ASSIGNMENT_INFO.labels(*labels).set(1)
        self._exported = series
