"""One subscription's ack window and drain (pure): ``partq.consumers.state.window.step``."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st
from partq.consumers.state import window as w
from partq.consumers.state.window import Phase, Window, step

PREFETCH = 3


def run(window: Window, *events: w.WindowEvent) -> tuple[Window, list[w.Action]]:
    actions: list[w.Action] = []
    for event in events:
        window, done = step(window, event)
        actions.extend(done)
    return window, actions


DELIVERED = w.Delivered()


def test_a_full_window_is_cancelled_at_once_then_ends_then_finishes() -> None:
    # Given a subscription with one delivery handed on and acked
    window, actions = run(Window(PREFETCH), DELIVERED, w.Acked((1,)))
    assert actions == [w.HandOn(), w.Ack((1,))]
    # When a drain begins, and 2 more arrive
    window, actions = run(window, w.Revoke(now=10.0), DELIVERED, DELIVERED)
    assert window.phase is Phase.HOLDING
    assert actions == [w.WaitQuiet(1, 1), w.HandOn(), w.HandOn()]
    # Then the delivery that fills the window is cancelled before it is handed on
    window, actions = step(window, DELIVERED)
    assert window.phase is Phase.CANCELLING and actions == (w.Cancel(), w.HandOn())
    # and acks are held from the drain on, END comes after CancelOk's round trip
    window, actions = run(window, w.Acked((2, 3)), w.CancelOk(), w.BarrierOk())
    assert actions == [w.Barrier(), w.SendEnd()] and window.phase is Phase.ENDING
    window, actions = run(window, w.Acked((4,)), w.Finish())
    assert actions == [w.AckEach((2, 3, 4)), w.ReportDrained()]
    assert window.phase is Phase.PARKED and window.acks_sent == 4


def test_a_quiet_drain_asks_the_queue_and_cancels_only_when_it_is_empty() -> None:
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=0.0))
    # Quiet since the drain began: count the queue's ready messages
    window, actions = step(window, w.Quiet(1, 1, now=0.25))
    assert actions == (w.AskReady(1, 1),)
    # Messages ready: the broker will deliver once our last acks are applied: wait
    window, actions = step(window, w.Ready(1, 1, ready=2, now=0.3))
    assert actions == (w.WaitQuiet(1, 1),)
    # Nothing ready and nothing arrived: cancel
    window, actions = step(window, w.Ready(1, 1, ready=0, now=0.6))
    assert actions == (w.Cancel(),) and window.phase is Phase.CANCELLING


def test_a_trickle_is_cancelled_after_the_longest_hold_with_its_wait_told() -> None:
    window, _ = run(Window(PREFETCH), w.Revoke(now=0.0), DELIVERED)
    window, actions = step(window, w.Quiet(1, 0, now=w.MAX_HOLD + 0.1))
    assert actions == (w.AskReady(1, 0),)
    window, actions = step(window, w.Ready(1, 0, ready=0, now=w.MAX_HOLD + 0.2))
    assert actions == (w.Cancel(overdue=w.MAX_HOLD + 0.2),)


def test_a_busy_partition_pausing_is_not_quiet_before_idle_its_window_fills_instead() -> None:
    # Given a drain of a partition delivering every 10 ms whose producer paused just before
    # it (issue 21: a loaded machine stalled the producer 0.21 s; the quiet cancel met the
    # resumed traffic in flight, and the quorum queue's channel returned 38 deliveries
    # behind newer messages)
    busy = w.Pace(last=9.95, gap=0.01)  # 2 credits left fill in 20 ms
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=10.0))
    # When the drain has seen no delivery for QUIET seconds, but the last was under IDLE ago
    window, actions = step(window, w.Quiet(1, 1, now=10.25, pace=busy))
    # Then it neither asks the queue nor cancels: it looks again
    assert actions == (w.WaitQuiet(1, 1),) and window.phase is Phase.HOLDING
    window, actions = step(window, w.Ready(1, 1, ready=0, now=10.3, pace=busy))
    assert actions == (w.WaitQuiet(1, 1),)
    # and once traffic resumes, the delivery that fills the window is what cancels it
    window, actions = run(window, DELIVERED, DELIVERED)
    assert actions == [w.HandOn(), w.Cancel(), w.HandOn()] and window.full
    # whereas one idle for IDLE seconds is asked about and cancelled as before
    idle = busy._replace(last=10.25 - w.IDLE)
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=10.0))
    window, actions = run(window, w.Quiet(1, 1, 10.25, idle), w.Ready(1, 1, 0, 10.3, idle))
    assert actions == [w.AskReady(1, 1), w.Cancel()]
    # and so is a trickle (a delivery every second): waiting would not fill its window
    trickle = w.Pace(last=9.95, gap=1.0)
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=10.0))
    window, actions = run(window, w.Quiet(1, 1, 10.25, trickle), w.Ready(1, 1, 0, 10.3, trickle))
    assert actions == [w.AskReady(1, 1), w.Cancel()]


def test_a_window_that_takes_fillers_is_filled_as_its_drain_begins_and_cancelled_full() -> None:
    # Given a subscription whose queue takes fillers, one delivery unacked
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED)
    # When its drain begins / Then it fills its credit (2) at once, and cancels nothing yet
    window, actions = step(window, w.Revoke(now=10.0))
    assert actions == (w.Fill(1, 2), w.WaitQuiet(1, 1)) and window.phase is Phase.HOLDING
    # and its timers neither fill again nor cancel while the fillers are on their way
    window, actions = step(window, w.Quiet(1, 1, now=10.25))
    assert actions == (w.WaitQuiet(1, 1),)
    # nor does the drain begun again (a leader's flapping assignment)
    window, actions = step(window, w.Revoke(now=10.3))
    assert actions == (w.WaitQuiet(2, 1),)
    # The fillers' deliveries fill the window: the cancel is the full window's, exact
    window, actions = run(window, DELIVERED, DELIVERED)
    assert actions == [w.HandOn(), w.Cancel(), w.HandOn()] and window.full
    # and a drain after this one fills again
    window, _ = run(window, w.Acked((1, 2, 3)), w.CancelOk(), w.BarrierOk(), w.Finish())
    assert window.phase is Phase.PARKED and window.filled_at is None
    # whereas a full window is cancelled at once, with no filler
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED, DELIVERED, DELIVERED)
    assert step(window, w.Revoke(now=0.0))[1] == (w.Cancel(),)


def test_a_drain_behind_anothers_active_consumer_is_cancelled_at_once_without_fillers() -> None:
    # Given a window with credit left whose queue takes fillers, and another member's
    # consumer active (it holds the claim): nothing can be in flight to us
    # (what it was sent before, settled)
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED, w.Acked((1,)))
    # When its drain begins / Then it is cancelled at once; fillers would go to that
    # consumer and leave ours waiting, to be activated should that one go
    window, actions = step(window, w.Revoke(now=0.0, waiting=True))
    assert actions == (w.Cancel(),) and window.phase is Phase.CANCELLING


def test_a_drain_behind_anothers_claim_with_a_delivery_in_hand_is_not_cancelled_at_once() -> None:
    # Given a consumer handling a delivery when another member's claim reaches it: it was
    # RabbitMQ's active consumer, and may still be (the holder's consumer gone with its
    # connection, a node's death cutting both)
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED)
    # When its drain begins as one behind another's consumer
    window, actions = step(window, w.Revoke(now=0.0, waiting=True))
    # Then it is not cancelled under the worker's feet (the broker would serve the holder
    # newer messages beside it): it holds its acks and drains the usual way
    assert w.Cancel() not in actions and window.phase is Phase.HOLDING


def test_fillers_that_never_fill_the_window_end_in_an_overdue_cancel() -> None:
    window, actions = run(Window(PREFETCH, fill=True), w.Revoke(now=0.0))
    assert actions == [w.Fill(1, 3), w.WaitQuiet(1, 0)]
    window, actions = step(window, w.Quiet(1, 0, now=w.FILL_WAIT - 0.01))
    assert actions == (w.WaitQuiet(1, 0),)
    window, actions = step(window, w.Quiet(1, 0, now=w.FILL_WAIT))
    assert actions == (w.Cancel(overdue=w.FILL_WAIT),)


def test_a_busy_partitions_drain_is_filled_by_its_own_traffic_not_by_fillers() -> None:
    # Given a subscription whose deliveries come every 0.01 s, the last one just now
    busy = w.Pace(last=0.0, gap=0.01)
    window, actions = run(Window(PREFETCH, fill=True), DELIVERED, w.Revoke(0.0, pace=busy))
    # Then its drain publishes no fillers: the credit left fills in 0.02 s
    assert actions == [w.HandOn(), w.WaitQuiet(1, 1)]
    # and the traffic fills it: the cancel is exact
    window, actions = run(window, DELIVERED, DELIVERED)
    assert w.Cancel() in actions and window.filled_at is None


def test_a_busy_drain_whose_traffic_stops_or_trickles_is_filled() -> None:
    busy = w.Pace(last=0.0, gap=0.01)
    held, _ = run(Window(PREFETCH, fill=True), DELIVERED, w.Revoke(0.0, pace=busy))
    # When a quiet timer finds no delivery since it was set: fill what is left
    _, actions = step(held, w.Quiet(1, 1, now=w.QUIET, pace=busy))
    assert actions == (w.Fill(1, 2), w.WaitQuiet(1, 1))
    # When deliveries came, but slower than would fill it within IDLE: fill
    window, _ = step(held, DELIVERED)
    slow = w.Pace(last=w.QUIET - 0.01, gap=w.IDLE)
    _, actions = step(window, w.Quiet(1, 1, now=w.QUIET, pace=slow))
    assert actions == (w.Fill(1, 1), w.WaitQuiet(1, 2))
    # When they keep coming at pace but the hold reached IDLE: fill anyway
    steady = w.Pace(last=w.IDLE - 0.01, gap=0.01)
    _, actions = step(window, w.Quiet(1, 1, now=w.IDLE, pace=steady))
    assert actions == (w.Fill(1, 1), w.WaitQuiet(1, 2))
    # and while they come at pace within IDLE, it waits
    _, actions = step(window, w.Quiet(1, 1, now=w.QUIET, pace=w.Pace(w.QUIET - 0.01, 0.01)))
    assert actions == (w.WaitQuiet(1, 2),)
    # and a partition idle at the revoke is filled at once
    idle = w.Pace(last=-1.0, gap=0.01)
    _, actions = run(Window(PREFETCH, fill=True), DELIVERED, w.Revoke(0.0, pace=idle))
    assert actions == [w.HandOn(), w.Fill(1, 2), w.WaitQuiet(1, 1)]


def test_a_queue_that_returns_its_fillers_is_cancelled_as_before_and_not_filled_again() -> None:
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED, w.Revoke(now=0.0))
    # When the fillers come back unroutable / Then the quiet cancel follows, as without
    window, actions = step(window, w.Unfilled(1))
    assert actions == (w.Cancel(),) and not window.fill
    # and an Unfilled of an older drain, or of one that filled meanwhile, cancels nothing
    window, _ = run(Window(PREFETCH, fill=True), DELIVERED, w.Revoke(0.0), w.Resume())
    window, _ = step(window, w.Revoke(1.0))
    assert step(window, w.Unfilled(1))[1] == ()
    full, _ = run(window, DELIVERED, DELIVERED)
    assert step(full, w.Unfilled(2))[1] == ()
    # and without fillers out, an Unfilled changes nothing but the flag
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(0.0))
    assert step(window, w.Unfilled(1))[1] == ()


def test_a_quiet_timer_that_fired_late_looks_again() -> None:
    # Given a drain of an idle partition whose process was stalled (load 15: a consumer ran
    # nothing for 2.3 s; what the broker sent meanwhile was still unread)
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=10.0))
    # When its quiet timer fires 2 s late / Then it looks again, later, before asking
    window, actions = step(window, w.Quiet(1, 1, now=12.3, late=2.05))
    assert actions == (w.WaitQuiet(1, 1),)
    # and a timer on time goes on as before
    window, actions = step(window, w.Quiet(1, 1, now=12.55, late=0.0))
    assert actions == (w.AskReady(1, 1),)


def test_timers_of_a_drain_called_off_do_nothing() -> None:
    window, _ = run(Window(PREFETCH), DELIVERED, w.Revoke(now=0.0), w.Acked((1,)))
    window, actions = step(window, w.Resume())
    assert actions == (w.Ack((1,)), w.ReportKept()) and window.phase is Phase.CONSUMING
    assert step(window, w.Quiet(1, 1, now=9.0))[1] == ()
    # and a new drain's timers are not the old one's
    window, _ = step(window, w.Revoke(now=10.0))
    assert step(window, w.Quiet(1, 1, now=19.0))[1] == ()
    assert step(window, w.Quiet(2, 1, now=10.3))[1] == (w.AskReady(2, 1),)


def test_an_early_window_is_emptied_when_full_and_handled_and_cut_sends_the_held_acks() -> None:
    window, _ = run(Window(PREFETCH, early=True), DELIVERED, DELIVERED, w.Revoke(now=0.0))
    window, actions = step(window, DELIVERED)  # full: no cancel, the worker still handles
    assert actions == (w.HandOn(),) and window.phase is Phase.HOLDING
    window, actions = run(window, w.Acked((1, 2)), w.Quiet(1, 3, now=1.0))
    assert actions == []  # full: no quiet rule applies, emptied is waited for
    window, actions = step(window, w.Acked((3,)))
    assert actions == (w.ReportEmptied(),) and window.phase is Phase.EMPTIED
    window, actions = run(window, w.Cut(), w.CancelOk())
    assert actions == [w.Cancel(), w.AckEach((1, 2, 3)), w.ReportDrained()]
    assert window.phase is Phase.PARKED


def test_a_drain_of_a_window_not_consumed_reports_the_channel_lost() -> None:
    parked = Window(PREFETCH, phase=Phase.PARKED)
    assert step(parked, w.Revoke(now=0.0))[1] == (w.ReportLost(),)
    assert step(parked, w.Cut())[1] == (w.ReportLost(),)


# -- properties ------------------------------------------------------------------------------


@dataclass
class Worker:
    """What the window's shell and the worker did: handed-on tags, acks, END."""

    handed: list[int] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)  # in the order the worker acked them
    sent: list[int] = field(default_factory=list)  # acks that went to the broker
    cancels: int = 0
    ended: bool = False
    emptied: int = 0
    now: float = 0.0
    last: float = float("-inf")  # when the last delivery arrived
    gap: float = 0.0  # the shell's mean gap between deliveries, as the script sets it


KINDS = (
    "delivered",
    "acked",
    "revoke",
    "quiet",
    "ready",
    "unfilled",
    "resume",
    "cut",
    "cancel-ok",
    "barrier-ok",
    "finish",
)


def _event(window: Window, worker: Worker, kind: str, n: int, amount: float) -> w.WindowEvent:
    """One event a shell could feed now: ``kind``, with ``n`` picking its details."""
    worker.now += amount
    unacked = [t for t in worker.handed if t not in worker.acked]
    drain = window.drains - (n % 2)  # the current drain's timer, or an older one's
    seen = window.received - (n % 3 == 0)
    events: dict[str, w.WindowEvent] = {
        "delivered": DELIVERED,
        "acked": w.Acked(tuple(unacked[: 1 + n])) if unacked else DELIVERED,
        "revoke": w.Revoke(worker.now, waiting=n == 4),
        "quiet": w.Quiet(drain, seen, worker.now, w.Pace(worker.last, worker.gap), n / 8),
        "ready": w.Ready(drain, seen, n % 2, worker.now, w.Pace(worker.last, worker.gap)),
        "unfilled": w.Unfilled(drain),
        "resume": w.Resume(),
        "cut": w.Cut(),
        "cancel-ok": w.CancelOk(),
        "barrier-ok": w.BarrierOk(),
        "finish": w.Finish(),
    }
    return events[kind]


@settings(max_examples=300, deadline=None)  # a shared, loaded machine: no per-example deadline
# a busy partition (a delivery every 25 ms) revoked in a pause and found with nothing ready
@example(False, False, [("delivered", 0, 0.1), ("revoke", 0, 0.1), ("ready", 2, 0.3)])
@given(
    st.booleans(),
    st.booleans(),
    st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 4), st.floats(0, 2.0)), max_size=60),
)
def test_acks_are_never_lost_or_sent_twice_and_one_cancel_at_most(
    early: bool, fill: bool, script: list[tuple[str, int, float]]
) -> None:
    window, worker = Window(PREFETCH, early=early, fill=fill), Worker()
    for kind, n, amount in script:
        event = _event(window, worker, kind, n, amount)
        before = window
        window, actions = step(window, event)
        if isinstance(event, w.Delivered):
            worker.last, worker.gap = worker.now, amount / 4
        if isinstance(event, w.Acked):
            worker.acked.extend(event.tags)
        for action in actions:
            match action:
                case w.HandOn():
                    # none after END, nor once the window was full and all handled
                    assert not worker.ended
                    assert before.phase in (Phase.CONSUMING, Phase.HOLDING, Phase.CANCELLING)
                    worker.handed.append(window.received)
                case w.Ack(tags) | w.AckEach(tags):
                    worker.sent.extend(tags)
                case w.Cancel(overdue):
                    worker.cancels += 1
                    # a cancel while credit may be left only once quiet (nothing ready), or
                    # overdue, or cut; never before IDLE after a delivery if the pace would
                    # fill the window by then (a paused producer's traffic would meet it)
                    credit = before.prefetch - (before.received - before.acks_sent)
                    filling = credit * worker.gap < w.IDLE and worker.now - worker.last < w.IDLE
                    quiet = isinstance(event, w.Ready) and event.ready == 0 and not filling
                    if before.fill:  # filled instead: with credit left only once they failed
                        quiet = isinstance(event, w.Unfilled)
                    waiting = isinstance(event, w.Revoke) and event.waiting
                    assert window.full or quiet or overdue or waiting or isinstance(event, w.Cut)
                case w.Fill(drain, count):
                    # once per drain, its whole credit, and never instead of a full window
                    assert before.fill and before.filled_at is None and drain == window.drains
                    assert count == before.prefetch - (before.received - before.acks_sent) > 0
                case w.SendEnd():
                    worker.ended = True
                case w.ReportEmptied():
                    worker.emptied += 1
                    assert early and window.full and set(worker.handed) <= set(worker.acked)
                case w.ReportKept():
                    assert worker.cancels == 0
                    worker.emptied = 0  # a later drain may be emptied again
        # Then acks go out in the worker's order, each once, and none while held
        assert worker.sent == worker.acked[: len(worker.sent)]
        assert worker.sent + list(window.held) == worker.acked
        assert window.acks_sent == len(worker.sent)
        assert not (window.held and not window.holding)
        assert worker.cancels <= 1 and worker.emptied <= 1
