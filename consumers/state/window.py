"""One subscription's ack window and drain, pure: ``step(window, event) -> (window, actions)``.

A partition's channel, from ``basic.consume`` to the drain's last ack::

    CONSUMING ──revoke──▶ HOLDING ──window full / quiet──▶ CANCELLING ──cancel-ok, barrier──▶ ENDING
        ▲                 │   │        (basic.cancel)                   (END to the worker)   │
        └──resume─────────┘   │                                                      finish (held
        ▲                     └──full, all handled──▶ EMPTIED ──cut──▶ CUTTING       acks sent)
        └──resume──────────────────────────────────────┘                 │ cancel-ok       │
                                                                           ▼                 ▼
                                                                         PARKED ◀────────────┘

(1) A drain (``Revoke``) holds the partition's acks, so the broker gets no new credit.
(2) ``basic.cancel`` goes as soon as the broker provably has no credit left: our own count of
unacked deliveries (``received - acks_sent``) equals the prefetch. It never exceeds what the
broker counts (acks can lag, deliveries can be in flight), and the broker never lets that
exceed the prefetch: when ours equals it, nothing is in flight and nothing more can be sent,
so a cancel returns nothing to the queue. A window that never fills (an idle partition, or
one slower than the prefetch) is cancelled once no delivery arrived for :data:`QUIET`
seconds and no message is ready in the queue (``Quiet``, then ``Ready``: the shell's timer
and passive declare), or after :data:`MAX_HOLD` seconds of a trickle (``Cancel.overdue``).
Such a cancel is the only one that can meet a delivery in flight, and a quorum queue's
channel returns such a delivery itself (the client never sees it), late under load: behind
newer messages the next owner was already given. So where the queue takes fillers
(``fill``: ``partq.consumers.broker.fillers``), a drain whose window is not full is *filled*:
``Fill``
publishes as many fillers as there is credit left, their deliveries (with whatever else was
ready) fill the window, and the full window's cancel follows, with nothing in flight. It
fills as it begins, unless the partition's own traffic fills the credit left within
:data:`IDLE` seconds at its pace (:func:`_fills_soon`): that drain waits for its traffic,
and fills what is left once a :data:`QUIET` spell passes without a delivery, the pace
slows, or it has held :data:`IDLE` seconds. Filling a busy partition at once made the next
owner's subscribe wait behind the fillers' Raft commands in the quorum queue: planned gap
p50 103 ms against 44 (docs/benchmarks.md). The fillers an owner did not need go to the
next owner, which acks them as it acks any. Only fillers that never
fill the window (a queue without a leader, a subscription RabbitMQ never activated) end in
a cancel with credit left, after :data:`FILL_WAIT` seconds, warned about. A queue that
takes no fillers (``Unfilled``: a stream declared by partq 0.2.0, a shrink's retired
queue) is cancelled as before: a partition whose recent pace (:class:`Pace`, from the
shell) would fill the window within :data:`IDLE` seconds is not taken for quiet before it
has been idle that long, a trickle not before :data:`MAX_HOLD` seconds.
(3) After CancelOk, a round trip (``Barrier``) lets any delivery sent before it arrive; END
follows them to the worker, which handles and acks everything, then ``Finish``: the held
acks go (``AckEach``) and, after one more round trip, the partition is drained.

With ``early`` (quorum queues), a full window takes a shorter way: once the worker has also
handled (and acked, into the hold) every delivery, the window is EMPTIED (reported: nothing
can arrive and nothing is left to handle), the controller releases the claim and then
``Cut``: ``basic.cancel``, the held acks after CancelOk, drained.

A drain called off before its cancel (``Resume``) sends its held acks and consumes on.

Nothing here does I/O or reads a clock: the shell (``partq.consumers.broker.channels``) feeds the
events,
with the time where a rule needs it, and carries out the actions in order. Timing rules are
transitions (``Quiet``, ``Ready``), so changing how a drain decides is a change here only.

The machine's terms (the window record, the events, the actions) are
:mod:`partq.consumers.state.windowterms`', named here too.

Threads. None: the shell calls :func:`step` on the pika I/O thread.
"""

from __future__ import annotations

from partq.consumers.state.windowterms import (
    HOLDING,
    REPORTS,
    Ack,
    AckEach,
    Acked,
    Action,
    Actions,
    AskReady,
    Barrier,
    BarrierOk,
    Cancel,
    CancelOk,
    Cut,
    Delivered,
    Fill,
    Finish,
    HandOn,
    Pace,
    Phase,
    Quiet,
    Ready,
    Reject,
    ReportDrained,
    ReportEmptied,
    ReportKept,
    ReportLost,
    Resume,
    Revoke,
    SendEnd,
    Unfilled,
    WaitQuiet,
    Window,
    WindowEvent,
)

__all__ = [
    "FILL_WAIT",
    "HAND",
    "IDLE",
    "MAX_HOLD",
    "QUIET",
    "REPORTS",
    "Ack",
    "AckEach",
    "Acked",
    "Action",
    "Actions",
    "AskReady",
    "Barrier",
    "BarrierOk",
    "Cancel",
    "CancelOk",
    "Cut",
    "Delivered",
    "Fill",
    "Finish",
    "HandOn",
    "Pace",
    "Phase",
    "Quiet",
    "Ready",
    "Reject",
    "ReportDrained",
    "ReportEmptied",
    "ReportKept",
    "ReportLost",
    "Resume",
    "Revoke",
    "SendEnd",
    "Unfilled",
    "WaitQuiet",
    "Window",
    "WindowEvent",
    "step",
]

QUIET = 0.25  # no delivery for this long while acks are held: nothing is in flight
# ... unless the partition's pace would fill the window within IDLE seconds: then only this
# long without a delivery counts. A cancel with credit left has what is in flight returned by
# a quorum queue's channel, late under load: a producer that stalls and resumes into such a
# cancel can have the returns come back behind newer messages.
IDLE = 1.0
# ... and a partition whose window has not filled by then (a steady trickle) is cancelled
# anyway. A shorter hold let a return reach the queue after the next owner was served
# so a trickling partition's handoff waits up to 5 s.
MAX_HOLD = 5.0
# With fillers: a window they have not filled this long after they went is cancelled anyway.
FILL_WAIT = 5.0


# The usual answer to a delivery (the shell may test ``is``). Every answer to one holds
# HandOn (last) or Reject.
HAND: Actions = (HandOn(),)
_REJECT: Actions = (Reject(),)
_NONE: Actions = ()


def step(window: Window, event: WindowEvent) -> tuple[Window, Actions]:
    """One event; the window after it and what the shell must do, in order."""
    match event:
        case Delivered():
            return _delivered(window)
        case Acked(tags):
            return _acked(window, tags)
        case Revoke(now, waiting, pace):
            return _revoke(window, now, pace, waiting=waiting)
        case Quiet(drain, seen, now, pace, late):
            # late: stalled, and what the broker sent meanwhile may not be read yet
            seen = seen if late <= QUIET else -1
            return _quiet(window, drain, seen, 0, (now, pace), asked=False)
        case Ready(drain, seen, ready, now, pace):
            return _quiet(window, drain, seen, ready, (now, pace), asked=True)
        case Unfilled(drain):
            return _unfilled(window, drain)
        case Resume():
            return _resume(window)
        case Cut():
            return _cut(window)
        case CancelOk():
            return _cancel_ok(window)
        case BarrierOk():
            return _barrier_ok(window)
        case Finish():
            return _finish(window)
    raise ValueError(f"unknown event {event!r}")


def _delivered(window: Window) -> tuple[Window, Actions]:
    """The per-message path: one count, and a full window's cancel before handing it on."""
    prefetch, early, phase, received, acks_sent, held, held_since, drains, fill, filled = window
    window = Window(
        prefetch, early, phase, received + 1, acks_sent, held, held_since, drains, fill, filled
    )
    if phase in (Phase.CONSUMING, Phase.CANCELLING):
        return window, HAND
    if phase is Phase.HOLDING:
        if window.full and not window.early:  # nothing else can come: cancel first
            return window._replace(phase=Phase.CANCELLING), (Cancel(), HandOn())
        return window, HAND
    # EMPTIED or CUTTING: no credit was left; PARKED, ENDING: no consumer. Never happens.
    return window, _REJECT


def _acked(window: Window, tags: tuple[int, ...]) -> tuple[Window, Actions]:
    prefetch, early, phase, received, acks_sent, held, held_since, drains, fill, filled = window
    if phase not in HOLDING:  # the per-ack-burst path: made positionally, as a delivery's
        acks_sent += len(tags)
        window = Window(
            prefetch, early, phase, received, acks_sent, held, held_since, drains, fill, filled
        )
        return window, (Ack(tags),)
    return _check_emptied(window._replace(held=window.held + tags))


def _check_emptied(window: Window) -> tuple[Window, Actions]:
    """EMPTIED once the window is full (nothing can be in flight) and every delivery has
    been handled: its ack is held, so none is left to handle."""
    if (
        window.early
        and window.phase is Phase.HOLDING
        and window.full
        and len(window.held) >= window.received - window.acks_sent
    ):
        return window._replace(phase=Phase.EMPTIED), (ReportEmptied(),)
    return window, _NONE


def _revoke(
    window: Window, now: float, pace: Pace, *, waiting: bool = False
) -> tuple[Window, Actions]:
    """Hold the acks; cancel (or wait for emptied) at once if the window is full, or if
    ``waiting``, else fill it (once a drain: a drain begun again waits for the fillers out)
    or look for quiet. Again on a drain under way: its timers restart."""
    if not window.consuming:
        return window, (ReportLost(),)
    phase = Phase.HOLDING if window.phase is Phase.CONSUMING else window.phase
    window = window._replace(phase=phase, held_since=now, drains=window.drains + 1)
    if waiting and phase is Phase.HOLDING and window.received == window.acks_sent:
        return _cancel(window)  # else it was served, so it may be the active one after all
    if window.full:
        if window.early:
            return _check_emptied(window)
        return _cancel(window)
    if phase is not Phase.HOLDING:
        return window, _NONE
    if window.fill and window.filled_at is None and not _fills_soon(window, now, pace):
        return _fill(window, now)
    return window, (WaitQuiet(window.drains, window.received),)


def _fills_soon(window: Window, now: float, pace: Pace, recent: float = QUIET) -> bool:
    """The partition's pace fills the credit left within :data:`IDLE` seconds, and its
    last delivery is under ``recent`` seconds old: a drain waits for its own traffic to
    fill the window rather than add fillers (they are Raft commands of a busy quorum
    queue, and the next owner's subscribe queues up behind them)."""
    return window.credit * pace.gap < IDLE and pace.idle(now) < recent


def _fill(window: Window, now: float) -> tuple[Window, Actions]:
    wait = (WaitQuiet(window.drains, window.received),)
    return window._replace(filled_at=now), (Fill(window.drains, window.credit), *wait)


def _quiet(
    window: Window, drain: int, seen: int, ready: int, at: tuple[float, Pace], *, asked: bool
) -> tuple[Window, Actions]:
    """A quiet timer (``asked``: its passive declare's answer) of drain ``drain``, ``at``
    (now, the channel's pace).

    Quiet (or held too long): a round trip makes sure whatever the broker sent before it
    has been read, also by a process that was stalled, and tells how many messages are
    ready. Quiet with messages ready means the broker has no credit for us *yet*: acks
    sent before the hold are not applied (a loaded broker lags), and once they are, it
    delivers again. Cancelling then returns those deliveries, and the next owner may be
    served before the returns are applied, and a key is reordered. So
    only an empty queue counts as quiet; and for a partition whose pace fills the credit
    left within :data:`IDLE` seconds, only that long without a delivery: a producer that
    paused for less resumes into our window, which fills (no credit left to race). A timer
    that fired more than :data:`QUIET` late (``seen`` -1: this process was stalled, and
    deliveries the broker sent meanwhile may still be unread) looks again instead."""
    if window.drains != drain or window.phase is not Phase.HOLDING:
        return window, _NONE  # called off (resume), cancelled, or emptied
    if window.early and window.full:
        return window, _NONE  # emptied is reported once the worker has handled it all
    now, pace = at
    waited = now - window.held_since
    if window.filled_at is not None:  # filled: only a full window cancels, or the wait ends
        if now - window.filled_at < FILL_WAIT:
            return window, (WaitQuiet(drain, window.received),)
        return _cancel(window, overdue=waited)
    if window.fill:  # its traffic was filling it: fill the rest once that slows or stops
        if window.received != seen and waited < IDLE and _fills_soon(window, now, pace):
            return window, (WaitQuiet(drain, window.received),)
        return _fill(window, now)
    paused = _fills_soon(window, now, pace, recent=IDLE)  # it would fill: wait for it
    busy = window.received != seen or ready > 0 or paused
    if busy and waited < MAX_HOLD:
        return window, (WaitQuiet(drain, window.received),)
    if not asked:
        return window, (AskReady(drain, seen),)
    return _cancel(window, overdue=waited if busy else None)


def _unfilled(window: Window, drain: int) -> tuple[Window, Actions]:
    """No fillers reach the queue: this window, and the drains after it, go without."""
    filled = window.filled_at is not None
    window = window._replace(fill=False, filled_at=None)
    if not filled or window.drains != drain or window.phase is not Phase.HOLDING or window.full:
        return window, _NONE  # called off, or cancelled, or filled meanwhile
    return _cancel(window)


def _cancel(window: Window, overdue: float | None = None) -> tuple[Window, Actions]:
    if window.phase in (Phase.CANCELLING, Phase.CUTTING):
        return window, _NONE
    return window._replace(phase=Phase.CANCELLING), (Cancel(overdue),)


def _resume(window: Window) -> tuple[Window, Actions]:
    """Un-hold a drain that has not cancelled: its held acks go, it consumes on."""
    if window.phase not in (Phase.HOLDING, Phase.EMPTIED):
        return window, _NONE  # not draining, or too late: drained follows
    held = window.held
    window = window._replace(
        phase=Phase.CONSUMING, held=(), acks_sent=window.acks_sent + len(held), filled_at=None
    )
    return window, ((Ack(held), ReportKept()) if held else (ReportKept(),))


def _cut(window: Window) -> tuple[Window, Actions]:
    if not window.consuming:
        return window, (ReportLost(),)
    if window.phase in (Phase.CANCELLING, Phase.CUTTING):
        return window, _NONE
    return window._replace(phase=Phase.CUTTING), (Cancel(),)


def _cancel_ok(window: Window) -> tuple[Window, Actions]:
    if window.phase is Phase.CANCELLING:
        return window, (Barrier(),)
    if window.phase is Phase.CUTTING:
        return _finish(window._replace(phase=Phase.PARKED))
    return window, _NONE


def _barrier_ok(window: Window) -> tuple[Window, Actions]:
    if window.phase is Phase.CANCELLING:
        return window._replace(phase=Phase.ENDING), (SendEnd(),)
    return window, _NONE


def _finish(window: Window) -> tuple[Window, Actions]:
    """Send the held acks, then report drained after a round trip. The phase: PARKED
    after END (ENDING); a finish while still consuming only flushes the hold."""
    held = window.held
    phase = {
        Phase.ENDING: Phase.PARKED,
        Phase.HOLDING: Phase.CONSUMING,
        Phase.EMPTIED: Phase.CONSUMING,
    }.get(window.phase, window.phase)
    window = window._replace(
        phase=phase, held=(), acks_sent=window.acks_sent + len(held), filled_at=None
    )
    return window, (AckEach(held), ReportDrained())
