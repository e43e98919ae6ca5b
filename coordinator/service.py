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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator import keys, metrics
from coordinator.assignor import assign, limit_moves
from coordinator.errors import EtcdUnavailable, NotLeader
from coordinator.etcd import etcd_errors
from coordinator.group import Claim, Group, GroupState, Member, WatchEvent
from coordinator.session import Session
from coordinator.streams import Registry
from producer import logs
from producer.contract import StreamSpec
from producer.errors import StreamNotFound

__all__ = ["CoordinatorConfig", "StreamCoordinator", "plan"]

log = logging.getLogger("partq.coordinator")
_TXN_OPS = 100  # etcd's default --max-txn-ops is 128


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
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, state: GroupState) -> _Mirror:
        return cls(
            dict(state.members),
            dict(state.assignment),
            dict(state.claims),
            {key: rev for rev, key in state.leaders},
            dict(state.requests),
        )


def drained(requests: dict[str, dict[str, Any]]) -> set[str]:
    return {r["member"] for name, r in requests.items() if name.startswith("drain-")}


def in_motion(assignment: dict[int, str], claims: dict[int, Claim]) -> set[int]:
    """Partitions whose assigned owner does not hold the claim yet."""
    return {p for p, owner in assignment.items() if claims.get(p, Claim("", 0)).member != owner}


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


class StreamCoordinator(threading.Thread):
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
        self._fence: tuple[str, int] | None = None
        self._mirror = _Mirror()
        self._settle_at: float | None = None
        self._assigned_once = False

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        self.events.put("stop")

    def run(self) -> None:
        with logs.bind(stream=self.stream):
            self._run()

    def _run(self) -> None:
        backoff = 0.2
        while not self.stopping.is_set():
            try:
                self._campaign()
                backoff = 0.2
            except (EtcdUnavailable, NotLeader, StreamNotFound) as e:
                # deposed, etcd away, or the stream deleted under us: campaign again later
                log.warning("%s: %s; retrying in %.1fs", self.stream, e, backoff)
                self._step_down()
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        self._step_down()

    def _campaign(self) -> None:
        self.spec = self.registry.read_spec(self.stream)
        session = Session(
            self.registry.client, self.registry.where, self.config.ttl,
            on_lost=lambda: self.events.put("lease-lost"),
        )  # fmt: skip
        candidate = keys.leader_candidate(self.stream, session.id)
        watch_id = None
        try:
            with etcd_errors(self.registry.where):
                self.registry.client.put(candidate, "", lease=session.lease)
            state = self.group.snapshot()
            self._mirror = _Mirror.of(state)
            self._fence = (candidate, self._mirror.leaders[candidate])
            watch_id = self.group.watch(state.revision, self.events.put)
            self._settle_at = time.monotonic() + self.config.settle
            self._loop()
        finally:
            self._step_down()
            if watch_id is not None:
                self.group.cancel_watch(watch_id)
            session.close(revoke=True)

    def _step_down(self) -> None:
        if self.leading.is_set():
            log.info("%s: no longer leading", self.stream)
        self.leading.clear()
        metrics.IS_LEADER.labels(self.stream).set(0)
        metrics.ASSIGNMENT_INFO.clear()

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
        m = self._mirror
        if event.kind == "member":
            if event.value is None:
                m.members.pop(event.name, None)
            else:
                v = event.value
                m.members[event.name] = Member(
                    event.name, int(v.get("weight", 1)), event.lease, str(v.get("host", "")),
                    int(v.get("pid", 0)), str(v.get("version", "")), float(v.get("started", 0)),
                )  # fmt: skip
            self._settle_at = time.monotonic() + self.config.settle
        elif event.kind == "assignment":
            if event.value is None:
                m.assignment.pop(int(event.name), None)
            else:
                m.assignment[int(event.name)] = event.value["owner"]
        elif event.kind == "claim":
            if event.value is None:
                m.claims.pop(int(event.name), None)
            else:
                m.claims[int(event.name)] = Claim(event.value["member"], event.lease)
        elif event.kind == "leader":
            key = keys.leader_prefix(self.stream) + event.name
            if event.value is None:
                m.leaders.pop(key, None)
            else:
                m.leaders.setdefault(key, event.revision)
        elif event.kind == "request":
            if event.value is None:
                m.requests.pop(event.name, None)
            else:
                m.requests[event.name] = event.value

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

    def _handle_request(self, name: str, request: dict[str, Any]) -> None:
        m = self._mirror
        if name == "rebalance":
            self._reconcile("manual")
            self.group.clear_request(name)
        elif name.startswith("move-"):
            partition, to = int(request["partition"]), str(request["to"])
            if to in m.members and self.spec and 0 <= partition < self.spec.partitions:
                self._write({**m.assignment, partition: to}, "move")
            else:
                log.warning(
                    "%s: ignoring move of %s to unknown member %s", self.stream, partition, to
                )
            self.group.clear_request(name)
        elif name.startswith("drain-"):
            member = str(request["member"])
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
                t.put(keys.assignment(self.stream, p), f'{{"owner": "{target[p]}", "v": 1}}')
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
        m = self._mirror
        live = {k for k in m.members}
        owned = {p: o for p, o in m.assignment.items() if o in live}
        metrics.MEMBERS.labels(self.stream).set(len(m.members))
        metrics.PARTITIONS_UNASSIGNED.labels(self.stream).set(self.spec.partitions - len(owned))
        metrics.PARTITIONS_IN_MOTION.labels(self.stream).set(len(in_motion(owned, m.claims)))
        weights = {k: v.weight for k, v in m.members.items()}
        total = sum(weights.values())
        worst = 0.0
        counts = {k: 0 for k in weights}
        for owner in owned.values():
            counts[owner] += 1
        for member, weight in weights.items():
            worst = max(worst, abs(counts[member] - self.spec.partitions * weight / total))
        metrics.IMBALANCE.labels(self.stream).set(worst)
        if self.leading.is_set():
            metrics.ASSIGNMENT_INFO.clear()
            for p, owner in sorted(owned.items()):
                metrics.ASSIGNMENT_INFO.labels(self.stream, str(p), owner, self.spec.queue(p)).set(
                    1
                )
