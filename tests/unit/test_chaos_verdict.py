"""The fault soak's checker (benchmarks.chaos.verdict) on made-up records and faults."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.chaos.verdict import Fault, Sample, judge, stalls


def rec(
    pid: int,
    partition: int,
    key: str,
    seq: int,
    start: float,
    *,
    redelivered: bool = False,
    published: float | None = None,
) -> dict[str, Any]:
    return {
        "pid": pid,
        "partition": partition,
        "key": key,
        "seq": seq,
        "start": start,
        "end": start + 0.01,
        "redelivered": redelivered,
        "published_ms": None if published is None else round(published * 1000),
    }


def test_a_clean_run_passes() -> None:
    records = [rec(1, 0, "a", n, float(n)) for n in range(5)]
    verdict = judge(records, {("a", n) for n in range(5)}, [])
    assert verdict.passed
    assert (verdict.lost, verdict.order_raw, verdict.overlaps) == (0, 0, 0)
    assert verdict.duplicates == {}


def test_a_confirmed_message_never_handled_fails_the_run() -> None:
    verdict = judge([rec(1, 0, "a", 0, 0.0)], {("a", 0), ("a", 1)}, [])
    assert not verdict.passed
    assert verdict.lost_examples == ["a:1"]


def test_a_late_redelivery_is_excused_only_by_a_kill_of_the_owner_that_held_it() -> None:
    # Given pid 1 handling key a, killed at t=2.5 while holding seq 3; pid 2 handles seq 4
    # first, then seq 3 comes back redelivered
    records = [
        rec(1, 0, "a", 0, 1.0),
        rec(1, 0, "a", 1, 2.0),
        rec(2, 0, "a", 4, 3.0),
        rec(2, 0, "a", 3, 3.5, redelivered=True),
    ]
    confirmed = {("a", n) for n in (0, 1, 3, 4)}
    killed = Fault(2.5, "consumer-kill", "c1", pid=1)
    # Then with the kill on record it is a raw violation but an explained one
    excused = judge(records, confirmed, [killed])
    assert (excused.order_raw, excused.order_unexplained) == (1, 0)
    assert excused.passed
    # And a SIGTERM (a graceful stop) or a kill of another process excuses nothing
    for fault in (
        Fault(2.5, "consumer-term", "c1", pid=1),
        Fault(2.5, "consumer-kill", "c9", pid=9),
    ):
        assert judge(records, confirmed, [fault]).order_unexplained == 1


def test_a_frozen_process_does_not_overlap_while_it_is_stopped() -> None:
    # Given pid 1 stopped from t=1 to t=5 in the middle of a handling, pid 2 handling at t=3
    records = [rec(1, 0, "a", 0, 0.9), rec(2, 0, "a", 1, 3.0)]
    records[0]["end"] = 5.2
    confirmed = {("a", 0), ("a", 1), ("a", 2)}
    frozen = Fault(1.0, "consumer-stop", "c1", pid=1, until=5.0)
    # Then without the freeze on record that is an overlap, with it none
    assert judge(records, confirmed, []).overlaps == 1
    assert judge(records, confirmed, [frozen]).overlaps == 0
    # And pid 2 handling after the SIGCONT while pid 1 finishes the call it was frozen
    # inside is an overlap, explained: pid 2 began during the freeze, so RabbitMQ had
    # noticed it and served the partition on (a running thread cannot be stopped)
    records.append(rec(2, 0, "a", 2, 5.1))
    verdict = judge(records, confirmed, [frozen])
    assert (verdict.overlaps_raw, verdict.overlaps) == (1, 0)


def test_a_next_owner_that_starts_only_after_the_resume_beside_the_call_is_unexplained() -> None:
    # Given pid 1 frozen from t=1 to t=5 inside a call it finishes at 5.2, and pid 2 that
    # began on the partition only at 5.1: the fence let it in before the call finished
    records = [rec(1, 0, "a", 0, 0.9), rec(2, 0, "a", 1, 5.1)]
    records[0]["end"] = 5.2
    frozen = Fault(1.0, "consumer-stop", "c1", pid=1, until=5.0)
    verdict = judge(records, {("a", 0), ("a", 1)}, [frozen])
    # Then that overlap is not explained
    assert (verdict.overlaps_raw, verdict.overlaps) == (1, 1)
    assert not verdict.passed


def test_duplicates_are_charged_to_the_latest_fault_before_them_and_split_by_how() -> None:
    records = [
        rec(1, 0, "a", 0, 1.0),
        rec(2, 0, "a", 0, 3.0, redelivered=True),  # after the kill at 2
        rec(2, 0, "b", 0, 5.0),
        rec(2, 0, "b", 0, 5.5),  # a second copy, still within the kill's horizon
        rec(2, 0, "c", 0, 50.0),
        rec(2, 0, "c", 0, 50.5),  # long after any fault
    ]
    faults = [Fault(0.5, "move", "p0->c2"), Fault(2.0, "rabbit-kill", "n1")]
    verdict = judge(records, {("a", 0), ("b", 0), ("c", 0)}, faults)
    assert verdict.duplicates == {
        "none (second copy)": 1,
        "rabbit-kill (redelivered)": 1,
        "rabbit-kill (second copy)": 1,
    }


def test_the_pause_after_a_fault_is_the_longest_gap_in_each_partition_up_to_the_next() -> None:
    # Given partition 0 handled every 0.1 s apart from a 2 s gap after a fault at 10
    # and partition 1 handled without a gap
    p0 = [rec(1, 0, "a", n, 9.0 + n / 10) for n in range(11)]  # 9.0 .. 10.0
    p0 += [rec(2, 0, "a", 11 + n, 12.0 + n / 10) for n in range(10)]
    p1 = [rec(1, 1, "b", n, 9.0 + n / 10) for n in range(40)]
    verdict = judge(p0 + p1, set(), [Fault(10.0, "consumer-kill", "c1", pid=1)])
    pause = verdict.pauses["consumer-kill"]
    assert pause["n"] == 2
    assert math.isclose(pause["max"], 2.0 - 0.01)
    assert pause["p50"] < 0.1


def test_a_partition_idle_past_the_limit_while_a_message_waits_fails_the_run() -> None:
    # Given partition 0 handled every second, then nothing from 9.01 to 50 although seq 10
    # was published at 9.5, and partition 1 idle from 10 to 50 with nothing published until
    # 49.9 (an idle producer, not a stall)
    p0 = [rec(1, 0, "a", n, float(n), published=n - 0.5) for n in range(10)]
    p0 += [rec(2, 0, "a", 10, 50.0, published=9.5)]
    p1 = [rec(1, 1, "b", n, float(n), published=n - 0.1) for n in range(11)]
    p1 += [rec(1, 1, "b", 11, 50.0, published=49.9)]
    confirmed = {("a", n) for n in range(11)} | {("b", n) for n in range(12)}
    verdict = judge(p0 + p1, confirmed, [])
    # Then p0's stall, from seq 10's publish to its handling, fails it, and p1's wait counts
    # only from its publish: 0.1 s
    assert not verdict.passed
    assert verdict.stalls == 1
    assert math.isclose(verdict.longest_stall, 50.0 - 9.5)
    assert verdict.stall_examples == ["p0: 40.5 s idle from 9.500"]
    p1_stalls = [s for s in stalls(p1) if s.seconds > 1.0]
    assert p1_stalls == []
    # And a wait within the limit passes
    assert judge(p0 + p1, confirmed, [], idle_limit=45.0).passed


def test_a_stall_counts_from_the_earliest_waiting_message_handled_after_it() -> None:
    # Given a gap from 1.01 to 20 on p0, and the first handling after it a message published
    # at 15 but a later one (a redelivery) published at 0.5: that one waited the whole gap
    records = [
        rec(1, 0, "a", 0, 1.0, published=0.4),
        rec(2, 0, "a", 2, 20.0, published=15.0),
        rec(2, 0, "a", 1, 20.5, redelivered=True, published=0.5),
    ]
    longest, *_ = stalls(records)
    assert (longest.partition, longest.since, longest.until) == (0, 1.01, 20.0)
    # And records with no publish time tell nothing of waiting
    assert stalls([rec(1, 0, "a", 0, 1.0), rec(1, 0, "a", 1, 50.0)]) == []


def test_memory_is_summed_up_per_process() -> None:
    samples = [Sample(1.0, "etcd m1", 7, 1024), Sample(2.0, "etcd m1", 7, 4096)]
    assert judge([], set(), [], samples).memory == {
        "etcd m1 (7)": {"first": 1.0, "max": 4.0, "last": 4.0, "samples": 2}
    }
