"""A partition's slot on a consumer (pure bookkeeping around the handoff state machine)."""

from __future__ import annotations

from typing import cast

from partq.consumers.control.slot import NOBODY, Behind, PartitionSlot, WorkerView
from partq.consumers.handling.worker import Worker
from partq.consumers.state.handoff import Event, Phase, Standby


class StoppableWorker:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def worker() -> Worker:
    return cast(Worker, StoppableWorker())


def test_a_taken_over_partition_counts_as_ours_until_the_assignment_names_another() -> None:
    # Given a partition we took over from a, still assigned to a
    slot = PartitionSlot(0, taken_from="a")
    assert slot.ours("a", "b", leaving=False)
    assert not slot.ours("a", "b", leaving=True)  # nothing is ours once leaving
    # When the leader gives it to c / Then the takeover is forgotten for good
    assert not slot.ours("c", "b", leaving=False)
    assert slot.taken_from is None
    assert not slot.ours("a", "b", leaving=False)
    assert slot.ours("b", "b", leaving=False)


def test_a_new_worker_waits_for_the_current_one_else_the_retired_one() -> None:
    # Given a retired worker and a current one
    retired, current = worker(), worker()
    slot = PartitionSlot(0, worker=current, retired=retired)
    # Then the current one is stopped and handed over, and the retired one kept
    assert slot.predecessor() is current
    assert cast(StoppableWorker, current).stopped and slot.retired is retired
    # and without a current one, the retired one is handed over once
    slot.worker = None
    assert slot.predecessor() is retired and slot.retired is None
    assert slot.predecessor() is None


def test_retiring_stops_the_worker_and_keeps_it_for_the_next() -> None:
    current = worker()
    slot = PartitionSlot(0, worker=current)
    slot.retire()
    assert (slot.worker, slot.retired) == (None, current)
    assert cast(StoppableWorker, current).stopped
    slot.retire()  # nothing more to retire: the retired one stays
    assert slot.retired is current


def test_the_freed_time_is_taken_once_and_behind_lasts_as_long_as_the_standby() -> None:
    slot = PartitionSlot(0, freed_at=12.5)
    assert (slot.take_freed_at(), slot.take_freed_at()) == (12.5, None)
    before, _ = slot.step(Event.STANDBY_WANTED)
    slot.stands_behind(Behind("a"))
    assert (before.standby, slot.state.standby) == (Standby.NONE, Standby.STANDING)
    slot.step(Event.ACTIVATED)
    assert slot.behind == Behind("a")  # the takeover check reads it
    slot.step(Event.TAKEN_OVER)
    assert (slot.state.phase, slot.behind) == (Phase.ACTIVE, NOBODY)


def test_a_freed_claim_and_a_yield_are_noted_by_the_step_that_tells_them() -> None:
    slot = PartitionSlot(0)
    slot.step(Event.ASSIGNED)
    slot.step(Event.CLAIM_FREE)
    assert slot.freed_at is not None
    assert (slot.take_freed_at() is not None, slot.take_freed_at()) == (True, None)
    slot.step(Event.CLAIMED)
    slot.step(Event.SUBSCRIBED)
    assert (slot.state.phase, slot.yielded_at) == (Phase.ACTIVE, 0.0)
    slot.step(Event.YIELD)
    assert slot.state.phase is Phase.YIELDING and slot.yielded_at > 0


def test_the_worker_view_shows_only_the_slots_with_a_worker() -> None:
    current = worker()
    slots = {0: PartitionSlot(0), 1: PartitionSlot(1, worker=current)}
    view = WorkerView(slots)
    assert (view.get(0), view.get(1), view.get(7)) == (None, current, None)
    assert dict(view) == {1: current} and len(view) == 1 and 0 not in view
