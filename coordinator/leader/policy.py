"""The leader's rules, pure: what to assign next, when, and what an operator request does.

Functions of the decoded group state (:mod:`partq.coordinator.store.codec` values, seen through
:class:`View`: a :class:`partq.coordinator.store.group.GroupState` snapshot or a
:class:`partq.coordinator.store.mirror.GroupMirror`); no I/O, no clock. The coordinator service
(:mod:`partq.coordinator.leader.service`) carries out what they decide; ``partq rebalance
--dry-run`` prints :func:`plan` of a snapshot, the same function the leader writes.

- **Draining.** A member an operator asked to drain (``partq drain``) is left out of
  every plan until it has left the group: :func:`draining`; so is a member that
  announced its stop (SIGTERM): :func:`leaving`, planned at once, without the settle.
- **Suspects.** A member a hot standby took a partition from (its connection died) gets
  nothing until the takeover claims turn ordinary; each partition it still holds goes to
  that partition's live standby, which RabbitMQ activates behind it: :func:`standing_heirs`.
- **In motion.** A partition is in motion while its assigned owner does not hold its
  claim: :func:`in_motion`.
- **Max moves.** With ``max_moves`` N, a plan moves at most N partitions away from a live
  owner, counting those already in motion from one; partitions without a (live) owner
  are assigned at once: :func:`plan`.
- **Settle and min members.** Membership changes (and becoming leader) restart a settle
  timer; the leader plans only once it has run out (:func:`settled`), and the first
  assignment waits for ``min_members`` members that are not draining: :func:`automatic`.
- **Balance by load** (``--balance load``, opt-in): with ``loads`` (each partition's
  messages per second, :mod:`partq.coordinator.leader.loads`), plans spread the members' loads
  instead of their partition counts: :func:`partq.coordinator.leader.loads.spread`, at most
  ``load_moves`` partitions moved from a live owner toward that (None: as many as it
  takes), then ``max_moves`` as above.
- **Operator requests** (:func:`requested`): ``rebalance`` plans one step and is cleared;
  ``move-<p>`` gives p to a live member and is cleared (ignored, and cleared, if the
  member is unknown or p is outside the stream); ``drain-<m>`` plans while m still owns
  partitions and is cleared once m has left.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from partq.coordinator.leader.assignor import assign, limit_moves
from partq.coordinator.leader.loads import spread
from partq.coordinator.store.codec import (
    Claim,
    Drain,
    Member,
    Move,
    Parked,
    Pause,
    Rebalance,
    Request,
)
from partq.producer.contract import StreamSpec, partition_for

__all__ = [
    "Reason",
    "Standbys",
    "Step",
    "View",
    "automatic",
    "differences",
    "draining",
    "forged_claims",
    "imbalance",
    "in_motion",
    "owned",
    "parked_by_holder",
    "plan",
    "requested",
    "settled",
    "standby_mode",
    "standing_heirs",
]

# Which members a leader names as hot standbys (``partq coordinator --standby/--no-standby``;
# neither: "auto"), :func:`standbys`
Standbys = Literal["auto", "on", "off"]


def standby_mode(flag: bool | None) -> Standbys:
    """The mode of ``--standby`` (True), ``--no-standby`` (False) or neither (None)."""
    return "auto" if flag is None else "on" if flag else "off"


# The ``reason`` label of partq_coordinator_rebalances_total
Reason = Literal[
    "startup", "membership", "step", "manual", "move", "drain", "pause", "takeover", "load"
]


class View(Protocol):
    """The group state the rules read (a snapshot or the leader's mirror)."""

    @property
    def members(self) -> Mapping[str, Member]: ...
    @property
    def assignment(self) -> Mapping[int, str]: ...
    @property
    def claims(self) -> Mapping[int, Claim]: ...
    @property
    def requests(self) -> Mapping[str, Request]: ...

    @property
    def standbys(self) -> Mapping[int, str]: ...


@dataclass(frozen=True, slots=True)
class Step:
    """What the leader does: write ``target`` (the partitions whose owner it changes), then
    delete the request if ``clear``. ``planned``: ``target`` is a :func:`plan`."""

    reason: Reason
    target: Mapping[int, str] | None = None  # None: write nothing
    planned: bool = False
    clear: bool = False
    ignored: str | None = None  # why the request is ignored (logged)


def draining(requests: Mapping[str, Request]) -> set[str]:
    """Members an operator asked to drain: no plan gives them partitions."""
    return {r.member for r in requests.values() if isinstance(r, Drain)}


def paused(requests: Mapping[str, Request], partition: int) -> bool:
    """Whether an operator paused ``partition`` (or the whole stream): its owner keeps it
    and its claim, and does not consume it."""
    return Pause().name in requests or Pause(partition).name in requests


def leaving(members: Mapping[str, Member]) -> set[str]:
    """Members that announced their stop: no plan gives them partitions."""
    return {m for m, member in members.items() if member.leaving}


def in_motion(assignment: Mapping[int, str], claims: Mapping[int, Claim]) -> set[int]:
    """Partitions whose assigned owner does not hold the claim yet."""
    held = {p: c.member for p, c in claims.items()}
    return {p for p, owner in assignment.items() if held.get(p) != owner}


def forged_claims(members: Mapping[str, Member], claims: Mapping[int, Claim]) -> dict[int, Claim]:
    """Claims partq never writes: on no lease, or on a live member's lease in another's name.

    partq puts a claim on the lease of the member it names (its own, or the heir's in a
    hand-over while the heir's member key is on that lease). A lease-less claim would never
    expire, and one on another member's lease would last as long as that member: written
    with a consumer's credentials (the ``claims/`` prefix is shared), they could stop a
    partition for good. Every reader ignores them
    (:class:`partq.coordinator.store.group.GroupState`,
    :class:`partq.coordinator.store.mirror.GroupMirror`) and the leader deletes them.
    """
    holders = {m.lease: m.id for m in members.values() if m.lease}
    return {
        p: c
        for p, c in sorted(claims.items())
        if c.lease == 0 or holders.get(c.lease, c.member) != c.member
    }


def unbound_claims(members: Mapping[str, Member], claims: Mapping[int, Claim]) -> dict[int, Claim]:
    """Claims on a lease that holds no live member key: a member that left (or restarted)
    while it drains, until it releases them or its lease ends. Honoured, but a lease can be
    kept alive by whoever granted it: the leader deletes them after a grace period
    (:func:`partq.coordinator.leader.forged.remove_unbound`). Pass ``claims`` without the
    :func:`forged_claims` (as readers see them)."""
    leases = {m.lease for m in members.values() if m.lease}
    return {p: c for p, c in sorted(claims.items()) if c.lease not in leases}


def parked_by_holder(
    record: Parked, partitions: int, claim: Claim | None, member: Member | None
) -> bool:
    """Whether ``record`` is one its partition's holder wrote: its key is in its partition,
    and the partition's ``claim`` when it was written names ``member``, the record's, on
    that member's lease. A consumer's credentials may write any ``parked/`` key (a shared
    prefix); a record that fails this would divert another holder's key: readers ignore
    it and the leader deletes it."""
    return (
        partition_for(record.key, partitions) == record.partition
        and claim is not None
        and member is not None
        and claim.member == record.member == member.id
        and claim.lease == member.lease != 0
    )


def suspects(claims: Mapping[int, Claim]) -> set[str]:
    """Members a hot standby took partitions from (their connection to RabbitMQ died): no
    plan gives them partitions until the takeover claims are made ordinary (after a lease
    TTL, when a dead member has left the group)."""
    return {c.taken_from for c in claims.values() if c.takeover and c.taken_from}


def standbys(spec: StreamSpec, view: View, which: Standbys = "on") -> dict[int, str]:
    """The hot standby of each settled partition (its live owner holds its claim): the next
    live member after the owner in sorted order, skipping leaving and draining ones; none
    with fewer than two such members. Deterministic, and spread like the owners.

    ``which``: ``"on"`` for every member, ``"off"`` for none, ``"auto"`` (the default) for
    every member on quorum queues and none on classic ones. Quorum queues are where hot
    standbys were shown to keep order through every fault kind, on RabbitMQ 4 (handoffs by
    consumer priority) and, since drains fill their windows (``partq.consumers.broker.fillers``),
    on 3.10
    (docs/benchmarks.md, "Randomized fault soak"); on classic queues they were never
    soaked."""
    if which == "off" or (which == "auto" and spec.queue_type != "quorum"):
        return {}
    out = draining(view.requests) | leaving(view.members) | suspects(view.claims)
    live = sorted(m for m in view.members if m not in out)
    if len(live) < 2:
        return {}
    chosen = {}
    for p, owner in sorted(view.assignment.items()):
        claim = view.claims.get(p)
        if p >= spec.partitions or owner not in live or claim is None or claim.member != owner:
            continue
        chosen[p] = live[(live.index(owner) + 1) % len(live)]
    return chosen


def standing_heirs(view: View, live: Collection[str]) -> dict[int, str]:
    """Each partition a suspect still holds (its owner's connection died: a standby took
    another of its partitions) whose named hot standby is live: that standby. RabbitMQ
    activates it, subscribed behind the dead owner, as it notices the death, and sends it
    what the owner held, first and in order; a plan giving the partition to anyone else
    makes the standby give that back, in order only if nothing is in flight to it then
    (seen in an 18-minute soak on RabbitMQ 4.0.5: 15 and 23 per-key order violations, at
    two kill -9s whose other partition a standby had just taken over)."""
    gone = suspects(view.claims)
    return {
        p: member
        for p, member in sorted(view.standbys.items())
        if view.assignment.get(p) in gone and member in live
    }


def takeovers(view: View) -> dict[int, str]:
    """Partitions a hot standby took over from their dead owner (a takeover claim by a live
    member that the assignment does not name yet): the assignment follows the claim, once.
    Only while the assignment still names the owner it was taken from (or no live member):
    once the leader has planned the partition elsewhere since, the plan stands; following
    the claim again would undo it, and the plan redo it, every few milliseconds until the
    claim is made ordinary a lease TTL later (seen: a partition flapping for 11 s)."""
    found = {}
    for p, c in sorted(view.claims.items()):
        owner = view.assignment.get(p)
        stale = owner is None or owner == c.taken_from or owner not in view.members
        if c.takeover and c.member in view.members and owner != c.member and stale:
            found[p] = c.member
    return found


def plan(
    spec: StreamSpec,
    view: View,
    max_moves: int | None,
    loads: Mapping[int, float] | None = None,
    load_moves: int | None = None,
) -> dict[int, str]:
    """The next assignment step (every partition of the stream, or {} without members);
    by partition count, or with ``loads`` by load (the module docstring)."""
    excluded = draining(view.requests) | leaving(view.members) | suspects(view.claims)
    weights = {m.id: m.weight for m in view.members.values() if m.id not in excluded}
    if not weights:
        return {}
    current = {p: o for p, o in view.assignment.items() if o in weights and p < spec.partitions}
    current |= {p: m for p, m in standing_heirs(view, weights).items() if p < spec.partitions}
    if loads is None:
        target = assign(spec.partitions, weights, current)
    else:
        target = spread(spec.partitions, weights, current, loads, max_moves=load_moves)
    budget = None
    if max_moves is not None:
        moving = {p for p in in_motion(current, view.claims) if view.claims.get(p) is not None}
        budget = max(0, max_moves - len(moving))
    return limit_moves(current, target, budget)


def settled(settle_at: float | None, now: float) -> bool:
    """Whether the settle timer (None: not running) has run out at ``now``."""
    return settle_at is None or now >= settle_at


def automatic(
    spec: StreamSpec,
    view: View,
    *,
    min_members: int,
    max_moves: int | None,
    first: bool,
    after_claim: bool,
    loads: Mapping[int, float] | None = None,
    load_moves: int | None = None,
    reason: Reason | None = None,
) -> Step | None:
    """Once settled, outside manual mode: the next plan step, or None while the first
    assignment still waits for ``min_members``. ``first``: nothing was planned yet;
    ``after_claim``: a claim changed (a new owner took a partition: the next max-moves step);
    ``loads``, ``load_moves``: balance by load (:func:`plan`); ``reason``: say so instead.
    """
    out = draining(view.requests) | leaving(view.members) | suspects(view.claims)
    live = [m for m in view.members if m not in out]
    if not view.assignment and len(live) < min_members:
        return None
    if reason is None:
        reason = "step" if after_claim else "startup" if first else "membership"
    return Step(reason, plan(spec, view, max_moves, loads, load_moves), planned=True)


def requested(
    request: Request,
    spec: StreamSpec,
    view: View,
    max_moves: int | None,
    loads: Mapping[int, float] | None = None,
) -> Step:
    """What an operator request stored in etcd makes the leader do (the module docstring)."""
    match request:
        case Rebalance():
            return Step("manual", plan(spec, view, max_moves, loads), planned=True, clear=True)
        case Move(partition=partition, to=to):
            if to in view.members and 0 <= partition < spec.partitions:
                return Step("move", {**view.assignment, partition: to}, clear=True)
            why = f"ignoring move of {partition} to unknown member {to}"
            return Step("move", clear=True, ignored=why)
        case Drain(member=member):
            if member not in view.members:
                return Step("drain", clear=True)  # it left: the drain is done
            if member in view.assignment.values():
                return Step("drain", plan(spec, view, max_moves, loads), planned=True)
            return Step("drain")
        case Pause():
            return Step("pause")  # for the owners (:func:`paused`); kept until resumed


def differences(policies: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Where coordinators' policies (candidate -> settings) disagree, one text per setting:
    ``"balance: count (1), load (2)"``; [] when they all agree (or there is one)."""
    names = sorted({name for policy in policies.values() for name in policy})
    out = []
    for name in names:
        counts: dict[str, int] = {}
        for policy in policies.values():
            shown = json.dumps(policy.get(name))
            counts[shown] = counts.get(shown, 0) + 1
        if len(counts) > 1:
            out.append(f"{name}: " + ", ".join(f"{v} ({n})" for v, n in sorted(counts.items())))
    return out


def owned(spec: StreamSpec, view: View) -> dict[int, str]:
    """The assignment of the stream's partitions to live members."""
    return {p: o for p, o in view.assignment.items() if o in view.members and p < spec.partitions}


def imbalance(spec: StreamSpec, members: Mapping[str, Member], owned: Mapping[int, str]) -> float:
    """The largest distance of a member's partition count from its weighted share."""
    total = sum(m.weight for m in members.values())
    counts = dict.fromkeys(members, 0)
    for owner in owned.values():
        counts[owner] += 1
    worst = 0.0
    for member_id, member in members.items():
        worst = max(worst, abs(counts[member_id] - spec.partitions * member.weight / total))
    return worst
