"""One partition's handoff state machine, pure: ``step(state, event) -> (state, commands)``.

revoke → drain → release → grant, as in docs/architecture.md::

    IDLE ──assigned──▶ CLAIMING ──claimed──▶ SUBSCRIBING ──subscribed──▶ ACTIVE
      ▲    (claim held by another: WAITING until it is deleted, or handed    │
      │     to us: granted ──▶ SUBSCRIBING)                                  │
      │                                                               unassigned
    RELEASING ◀──drained (cancel-ok, every delivery acked, channel closed)── DRAINING
                                                                            │
    IDLE ◀──drained── HANDING (claim released, then basic.cancel) ◀──emptied─┘

``emptied``: the drain holds its acks until the broker provably has no credit left
(nothing can be in flight) and the worker has handled every delivery; then the claim
goes *before* the cancel, so the next owner claims while we cancel and send the acks
(``consumers.broker``, "emptied"). A drain that cannot prove it (a quiet or trickling
partition) cancels first and releases after ``drained``, as before.

A drain of a partition that becomes ours again before its cancel is sent (assigned back:
a leader's assignment can flap right after a takeover) is called off (``resume``): the
held acks go and the partition stays ACTIVE once the broker says ``kept``. Cancelling it
only to subscribe again would activate a hot standby that subscribed behind us meanwhile;
an activated standby can give a planned move's deliveries back only out of order.

A release hands the claim straight to the member the partition is assigned to when that
member is alive (``Group.hand_over``: one transaction, on its lease), and deletes it
otherwise; the heir sees ``granted`` and subscribes without a claim of its own.

An operator's pause (``paused``) drains an ACTIVE partition the same way but keeps it:
DRAINING ──drained──▶ PAUSED (claim held, not consumed) ──resumed──▶ SUBSCRIBING.

The shell (``consumers.daemon``) turns etcd watch events and the broker's events
into events and carries out the commands; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = ["Command", "Event", "Holder", "Phase", "State", "step"]


class Phase(Enum):
    IDLE = "idle"
    WAITING = "waiting"  # assigned to us, another member still holds the claim
    CLAIMING = "claiming"
    SUBSCRIBING = "subscribing"
    ACTIVE = "active"
    DRAINING = "draining"
    RELEASING = "releasing"
    PAUSED = "paused"  # ours (assigned, claimed) but not consumed: an operator paused it
    HANDING = "handing"  # emptied and released before the cancel: waiting for drained


class Holder(Enum):
    NOBODY = "nobody"
    ME = "me"
    OTHER = "other"


class Event(Enum):
    ASSIGNED = "assigned"  # the assignment names us
    UNASSIGNED = "unassigned"
    CLAIM_FREE = "claim-free"  # the claim key was deleted
    CLAIM_OTHER = "claim-other"
    GRANTED = "granted"  # a claim on our lease that we did not write: handed over to us
    CLAIMED = "claimed"  # our claim transaction succeeded
    CLAIM_REFUSED = "claim-refused"
    SUBSCRIBED = "subscribed"  # basic.consume-ok
    DRAINED = "drained"
    EMPTIED = "emptied"  # draining: all handled, nothing in flight, still subscribed
    RELEASED = "released"
    CHANNEL_LOST = "channel-lost"  # the broker closed our channel or connection
    PAUSED = "paused"  # an operator paused the partition
    RESUMED = "resumed"
    KEPT = "kept"  # a drain called off before its cancel: consuming on (``Command.RESUME``)


class Command(Enum):
    CLAIM = "claim"
    SUBSCRIBE = "subscribe"
    CANCEL = "cancel"  # basic.cancel, finish and ack what was delivered, close the channel
    RELEASE = "release"
    CUT = "cut"  # after emptied: basic.cancel now, then the held acks, then drained
    RESUME = "resume"  # call off a drain whose cancel is not sent yet: kept, if it could


@dataclass(frozen=True, slots=True)
class State:
    phase: Phase = Phase.IDLE
    assigned: bool = False
    holder: Holder = Holder.NOBODY
    paused: bool = False

    @property
    def consuming(self) -> bool:
        return self.phase in (Phase.SUBSCRIBING, Phase.ACTIVE, Phase.DRAINING, Phase.HANDING)


def _want(state: State) -> tuple[State, list[Command]]:
    """From IDLE: go for the partition if it is assigned to us."""
    if not state.assigned:
        return replace(state, phase=Phase.IDLE), []
    if state.holder is Holder.OTHER:
        return replace(state, phase=Phase.WAITING), []
    if state.holder is Holder.ME:  # our claim survived (e.g. after a broker reconnect)
        return _consume(state)
    return replace(state, phase=Phase.CLAIMING), [Command.CLAIM]


def _consume(state: State) -> tuple[State, list[Command]]:
    """Assigned and claimed by us: subscribe, unless paused."""
    if state.paused:
        return replace(state, phase=Phase.PAUSED), []
    return replace(state, phase=Phase.SUBSCRIBING), [Command.SUBSCRIBE]


def _keeps(state: State) -> bool:
    """A drain of a partition that is ours again (assigned, our claim, not paused)."""
    return (
        state.phase is Phase.DRAINING
        and state.assigned
        and state.holder is Holder.ME
        and not state.paused
    )


def step(state: State, event: Event) -> tuple[State, list[Command]]:
    """One event; a drain that the event makes ours again is called off (``RESUME``)."""
    after, commands = _step(state, event)
    if _keeps(after) and not _keeps(state) and Command.RESUME not in commands:
        commands = [*commands, Command.RESUME]
    return after, commands


def _step(state: State, event: Event) -> tuple[State, list[Command]]:  # noqa: C901, PLR0912, PLR0915 — the transition table: one branch per (phase, event), read top to bottom
    phase = state.phase
    if event is Event.PAUSED:
        state = replace(state, paused=True)
        if phase is Phase.ACTIVE:
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        return state, []  # SUBSCRIBING: cancelled once subscribed; DRAINING: kept when drained
    if event is Event.RESUMED:
        state = replace(state, paused=False)
        if phase is Phase.PAUSED:  # the claim may have gone meanwhile: claim or wait first
            return _want(state)
        return state, []
    if event is Event.ASSIGNED:
        state = replace(state, assigned=True)
        return _want(state) if phase in (Phase.IDLE, Phase.WAITING) else (state, [])
    if event is Event.UNASSIGNED:
        state = replace(state, assigned=False)
        if phase is Phase.ACTIVE:
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        if phase is Phase.WAITING:
            return replace(state, phase=Phase.IDLE), []
        if phase is Phase.PAUSED:
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return state, []  # CLAIMING/SUBSCRIBING finish first; DRAINING/RELEASING go on
    if event is Event.CLAIM_FREE:
        state = replace(state, holder=Holder.NOBODY)
        if phase is Phase.ACTIVE:  # our claim vanished under us: stop, then start over
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        return _want(state) if phase in (Phase.WAITING, Phase.PAUSED) else (state, [])
    if event is Event.CLAIM_OTHER:
        state = replace(state, holder=Holder.OTHER)
        if phase is Phase.ACTIVE:  # a standby took it over (our connection had died): stop
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        if phase is Phase.PAUSED:  # kept while paused, but the claim is no longer ours
            return _want(state)
        return state, []
    if event is Event.GRANTED:
        state = replace(state, holder=Holder.ME)
        if phase not in (Phase.IDLE, Phase.WAITING, Phase.CLAIMING):
            return state, []  # ours already (an echo), or a drain that goes on
        if not state.assigned:  # moved on before it reached us: let it go
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return _consume(state)  # CLAIMING: its own claim's answer is stale now
    if event is Event.CLAIMED:
        if phase is not Phase.CLAIMING:  # a stale answer
            return state, []
        state = replace(state, holder=Holder.ME)
        if not state.assigned:  # unassigned while the claim was in flight
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return _consume(state)
    if event is Event.CLAIM_REFUSED:
        if phase is not Phase.CLAIMING:
            return state, []
        state = replace(state, holder=Holder.OTHER)
        return (replace(state, phase=Phase.WAITING if state.assigned else Phase.IDLE), [])
    if event is Event.SUBSCRIBED:
        if phase is not Phase.SUBSCRIBING:
            return state, []
        if not state.assigned or state.holder is not Holder.ME or state.paused:
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        return replace(state, phase=Phase.ACTIVE), []
    if event is Event.EMPTIED:
        if phase is not Phase.DRAINING:
            return state, []
        if not state.assigned and state.holder is Holder.ME:  # moved away: release first
            return replace(state, phase=Phase.HANDING), [Command.RELEASE, Command.CUT]
        if _keeps(state):  # moved back: nothing was cancelled, so nothing need be
            return state, [Command.RESUME]
        return state, [Command.CUT]  # kept (paused), or the claim is gone
    if event is Event.KEPT:
        if phase is not Phase.DRAINING:
            return state, []
        if _keeps(state):
            return replace(state, phase=Phase.ACTIVE), []
        return state, [Command.CANCEL]  # moved away again meanwhile: a drain anew
    if phase is Phase.HANDING and event in (Event.DRAINED, Event.CHANNEL_LOST):
        if state.holder is Holder.ME:  # the early release failed, or it was handed back
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return _want(replace(state, phase=Phase.IDLE))
    if event is Event.DRAINED:
        if phase is not Phase.DRAINING:
            return state, []
        if state.paused and state.assigned and state.holder is Holder.ME:
            return replace(state, phase=Phase.PAUSED), []  # kept, claim and all
        return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
    if event is Event.RELEASED:
        if phase is Phase.HANDING:  # released before the cancel: drained comes next
            return replace(state, holder=Holder.NOBODY), []
        return _want(replace(state, phase=Phase.IDLE, holder=Holder.NOBODY))
    if event is Event.CHANNEL_LOST:
        if phase in (Phase.SUBSCRIBING, Phase.ACTIVE):
            if state.assigned and state.holder is Holder.ME:
                return _consume(state)
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        if phase is Phase.DRAINING:  # the broker requeued what was unacked: nothing to finish
            if state.assigned and state.holder is Holder.ME and state.paused:
                return replace(state, phase=Phase.PAUSED), []
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return state, []
    raise ValueError(f"unknown event {event!r}")
