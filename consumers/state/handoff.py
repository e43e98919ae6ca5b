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
(``partq.consumers.broker.connection``, "emptied"). A drain that cannot prove it (a quiet or
trickling
partition) cancels first and releases after ``drained``, as before.

A drain under way whose claim becomes another member's is cancelled again: that member
took it over only once RabbitMQ served its consumer, so ours only waits, and the shell
cancels a waiting consumer at once (``Broker.cancel(waiting=True)``, as for any drain
begun while another holds the claim) rather than leave it subscribed, to be activated
should that member's consumer go; at once only if nothing it was sent is unsettled, else
the usual way (``partq.consumers.state.window.Revoke``).

A drain of a partition that becomes ours again before its cancel is sent (assigned back:
a leader's assignment can flap right after a takeover) is called off (``resume``): the
held acks go and the partition stays ACTIVE once the broker says ``kept``. Cancelling it
only to subscribe again would activate a hot standby that subscribed behind us meanwhile;
an activated standby can give a planned move's deliveries back only out of order.

A release hands the claim straight to the member the partition is assigned to when that
member is alive (``Group.hand_over``: one transaction, on its lease), and deletes it
otherwise; the heir sees ``granted`` and subscribes without a claim of its own.

By consumer priority (``partq.consumers.state.priority``; RabbitMQ 4 quorum queues, ``--handoff
auto``): an ACTIVE partition moved to a member that hands over by priority too is not
drained but *yielded* (``yield``): YIELDING, consumed on, until the heir, subscribed above
us, takes the claim over once the broker switched to it (``claim-other``: then the cancel,
with nothing checked out to us); assigned back, it is ACTIVE again; unassigned with no
such heir any more (or idle past ``YIELD_WAIT``), drained as usual. The heir is a hot
standby subscription made from WAITING (the phases below), with a priority.

An operator's pause (``paused``) drains an ACTIVE partition the same way but keeps it:
DRAINING ──drained──▶ PAUSED (claim held, not consumed) ──resumed──▶ SUBSCRIBING.

Hot standby (``partq.consumers.state.standby``) is a second, smaller phase of the same state,
``standby``: NONE ──standby-wanted──▶ STANDING (subscribed behind the owner's consumer,
only from IDLE) ──activated──▶ ACTIVATED (RabbitMQ made it the active consumer: the
owner's connection died, or it cancelled) ──taken-over──▶ NONE, and the partition is
ACTIVE on our takeover claim (``promote``: the standby's deliveries go to a new worker);
or ──takeover-refused──▶ NONE (``give-back``: a planned move, returned in order). A
standby never lives beside our own consumption of the partition: when we start consuming
(the claim is ours) one still standing or activated is *adopted* (``adopt``): its
subscription becomes the partition's, keeping its place in the queue's line, and what it
was sent goes to the new worker, rather than given back for a subscription beside it (the
shell gives back an heir of another priority than our claim's, and subscribes anew). An
activation of a standby no longer standing (stood down or lost before RabbitMQ's
activation reached us) is given back at once. A standby is not kept for a planned move to
us: the old owner's quiet drain cancels first and may have deliveries returned after it,
which a standby activated by that cancel would be served behind newer ones (seen on
RabbitMQ 3.10, holding it instead of giving it back). ``dropped`` (a fence aborted the
connection) starts the partition over from IDLE, without a drain, and with no standby: the
fence aborted that subscription too, silently, so the next sync stands by again where the
leader still names us.

The shell (``partq.consumers.control.partitions``) turns etcd watch events and the broker's events
into events and carries out the commands; nothing here does I/O.

Threads. None, and no shared state: :func:`step` is called on the daemon's controller
thread (``PartitionSlot.step``), with values it alone holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = ["Command", "Event", "Holder", "Phase", "Standby", "State", "step"]


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
    YIELDING = (
        "yielding"  # unassigned, consumed on: the heir outranks us (partq.consumers.state.priority)
    )


class Holder(Enum):
    NOBODY = "nobody"
    ME = "me"
    OTHER = "other"


class Standby(Enum):
    NONE = "none"
    STANDING = "standing"  # subscribed behind the owner's consumer, waiting
    ACTIVATED = "activated"  # RabbitMQ made it the active consumer: take over or give back


class Event(Enum):
    ASSIGNED = "assigned"  # the assignment names us
    UNASSIGNED = "unassigned"
    YIELD = "yield"  # unassigned, and the new owner will take it over by priority
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
    STANDBY_WANTED = "standby-wanted"  # the group wants us standing by (``standby.wanted``)
    STANDBY_UNWANTED = "standby-unwanted"
    STANDBY_LOST = "standby-lost"  # the standby's channel went (or could not be opened)
    ACTIVATED = "activated"  # RabbitMQ activated our standby subscription
    TAKEN_OVER = "taken-over"  # our takeover of the dead owner's claim was written
    TAKEOVER_REFUSED = "takeover-refused"  # the activation came from a planned move
    DROPPED = "dropped"  # the connection was aborted (a fence): every subscription gone


class Command(Enum):
    CLAIM = "claim"
    SUBSCRIBE = "subscribe"
    CANCEL = "cancel"  # basic.cancel, finish and ack what was delivered, close the channel
    RELEASE = "release"
    CUT = "cut"  # after emptied: basic.cancel now, then the held acks, then drained
    RESUME = "resume"  # call off a drain whose cancel is not sent yet: kept, if it could
    STAND_BY = "stand-by"  # subscribe behind the owner's consumer
    STAND_DOWN = "stand-down"  # cancel a standby subscription not activated
    GIVE_BACK = "give-back"  # return an activated standby's deliveries in order, cancel it
    PROMOTE = "promote"  # the activated standby becomes the subscription, with a new worker
    ADOPT = "adopt"  # SUBSCRIBE by making the standby subscription ours (``adopt``)


@dataclass(frozen=True, slots=True)
class State:
    phase: Phase = Phase.IDLE
    assigned: bool = False
    holder: Holder = Holder.NOBODY
    paused: bool = False
    standby: Standby = Standby.NONE

    @property
    def consuming(self) -> bool:
        return self.phase in (
            Phase.SUBSCRIBING,
            Phase.ACTIVE,
            Phase.YIELDING,
            Phase.DRAINING,
            Phase.HANDING,
        )


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


_STANDBY_EVENTS = frozenset(
    {
        Event.STANDBY_WANTED,
        Event.STANDBY_UNWANTED,
        Event.STANDBY_LOST,
        Event.ACTIVATED,
        Event.TAKEN_OVER,
        Event.TAKEOVER_REFUSED,
    }
)


def step(state: State, event: Event) -> tuple[State, list[Command]]:
    """One event; a drain that the event makes ours again is called off (``RESUME``), and
    a standby of a partition we now consume is ended (stood down, or given back)."""
    if event is Event.DROPPED:  # the standby subscription went with the connection too
        return State(), []
    if event in _STANDBY_EVENTS:
        after, commands = _standby_step(state, event)
    else:
        after, commands = _step(state, event)
    if _keeps(after) and not _keeps(state) and Command.RESUME not in commands:
        commands = [*commands, Command.RESUME]
    if after.standby is Standby.NONE:
        return after, commands
    if Command.SUBSCRIBE in commands:  # the claim is ours: the standby becomes the subscription
        adopt: list[Command] = [Command.ADOPT if c is Command.SUBSCRIBE else c for c in commands]
        return replace(after, standby=Standby.NONE), adopt
    if after.consuming and after.standby is Standby.STANDING:
        after, commands = replace(after, standby=Standby.NONE), [Command.STAND_DOWN, *commands]
    elif after.consuming and after.standby is Standby.ACTIVATED:
        after, commands = replace(after, standby=Standby.NONE), [Command.GIVE_BACK, *commands]
    return after, commands


def _standby_step(state: State, event: Event) -> tuple[State, list[Command]]:
    """The hot standby's events (the module docstring)."""
    standby = state.standby
    if event is Event.STANDBY_WANTED:  # WAITING: an heir subscribed above the owner
        if standby is Standby.NONE and state.phase in (Phase.IDLE, Phase.WAITING):
            return replace(state, standby=Standby.STANDING), [Command.STAND_BY]
        return state, []
    if event is Event.STANDBY_UNWANTED:
        if standby is Standby.STANDING:
            return replace(state, standby=Standby.NONE), [Command.STAND_DOWN]
        return state, []
    if event is Event.STANDBY_LOST:  # the broker dropped it: nothing to cancel
        return replace(state, standby=Standby.NONE), []
    if event is Event.ACTIVATED:
        if standby is Standby.NONE:  # stood down already: nothing to take over
            return state, [Command.GIVE_BACK]
        return replace(state, standby=Standby.ACTIVATED), []
    if standby is not Standby.ACTIVATED:  # a decision on a standby that is gone: stale
        return state, []
    if event is Event.TAKEN_OVER:  # ours on our takeover claim, consumed at once
        return State(Phase.ACTIVE, assigned=True, holder=Holder.ME), [Command.PROMOTE]
    return replace(state, standby=Standby.NONE), [Command.GIVE_BACK]  # TAKEOVER_REFUSED


def _step(state: State, event: Event) -> tuple[State, list[Command]]:  # noqa: C901, PLR0912, PLR0915 — the transition table: one branch per (phase, event), read top to bottom
    phase = state.phase
    if event is Event.YIELD:
        if phase is not Phase.ACTIVE:
            return _step(state, Event.UNASSIGNED)
        return replace(state, phase=Phase.YIELDING, assigned=False), []
    if event is Event.PAUSED:
        state = replace(state, paused=True)
        if phase in (Phase.ACTIVE, Phase.YIELDING):
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        return state, []  # SUBSCRIBING: cancelled once subscribed; DRAINING: kept when drained
    if event is Event.RESUMED:
        state = replace(state, paused=False)
        if phase is Phase.PAUSED:  # the claim may have gone meanwhile: claim or wait first
            return _want(state)
        return state, []
    if event is Event.ASSIGNED:
        state = replace(state, assigned=True)
        if phase is Phase.YIELDING:  # ours again before the heir took it: consuming on
            return replace(state, phase=Phase.ACTIVE), []
        return _want(state) if phase in (Phase.IDLE, Phase.WAITING) else (state, [])
    if event is Event.UNASSIGNED:
        state = replace(state, assigned=False)
        if phase in (Phase.ACTIVE, Phase.YIELDING):  # YIELDING: no heir to take it any more
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        if phase is Phase.WAITING:
            return replace(state, phase=Phase.IDLE), []
        if phase is Phase.PAUSED:
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return state, []  # CLAIMING/SUBSCRIBING finish first; DRAINING/RELEASING go on
    if event is Event.CLAIM_FREE:
        state = replace(state, holder=Holder.NOBODY)
        if phase in (Phase.ACTIVE, Phase.YIELDING):  # our claim vanished: stop, start over
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        return _want(state) if phase in (Phase.WAITING, Phase.PAUSED) else (state, [])
    if event is Event.CLAIM_OTHER:
        state = replace(state, holder=Holder.OTHER)
        # ACTIVE: a standby took it over (our connection had died); YIELDING: the heir did,
        # once the broker had switched to it (we hold nothing, and are sent nothing): stop
        if phase in (Phase.ACTIVE, Phase.YIELDING):
            return replace(state, phase=Phase.DRAINING), [Command.CANCEL]
        if phase is Phase.DRAINING:  # the same, learnt mid-drain: ours waits, cancel it now
            return state, [Command.CANCEL]
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
        if phase in (Phase.SUBSCRIBING, Phase.ACTIVE, Phase.YIELDING):
            if state.assigned and state.holder is Holder.ME:
                return _consume(state)
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        if phase is Phase.DRAINING:  # the broker requeued what was unacked: nothing to finish
            if state.assigned and state.holder is Holder.ME and state.paused:
                return replace(state, phase=Phase.PAUSED), []
            return replace(state, phase=Phase.RELEASING), [Command.RELEASE]
        return state, []
    raise ValueError(f"unknown event {event!r}")
