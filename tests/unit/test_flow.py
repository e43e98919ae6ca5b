"""The stall detector's rule: an owned partition whose worker waits while messages are ready."""

from __future__ import annotations

from partq.consumers.state.flow import FlowWatch


def test_a_waiting_worker_with_messages_ready_is_a_stall_told_once_until_it_ends() -> None:
    watch = FlowWatch()
    # partition 1's worker waits with 1,478 ready; 2's waits on an empty queue; 3 is busy
    first = watch.check({1, 2, 3}, {1, 2}, {1: 1478, 2: 0})
    assert dict(first.began) == {1: 1478} and first.ended == () and first.stalled == {1}
    again = watch.check({1, 2, 3}, {1, 2}, {1: 1500, 2: 0})
    assert dict(again.began) == {} and again.stalled == {1}  # not told twice
    unanswered = watch.check({1, 2, 3}, {1}, {})
    assert unanswered.stalled == {1}  # no count this time: the last verdict stands
    flowing = watch.check({1, 2, 3}, set(), {})
    assert flowing.ended == (1,) and flowing.stalled == frozenset()


def test_a_partition_no_longer_owned_or_a_busy_worker_is_not_a_stall() -> None:
    watch = FlowWatch()
    watch.check({1}, {1}, {1: 5})
    assert watch.check(set(), {1}, {1: 5}).ended == (1,)  # moved away
    assert watch.check({1}, set(), {1: 5}).stalled == frozenset()  # its handler runs
