"""The invariant checker on synthetic records: it must flag what it exists to catch."""

from __future__ import annotations

from typing import Any

from consumers import audit as checker


def rec(pid: int, partition: int, key: str, seq: int, start: float, end: float) -> dict[str, Any]:
    return {
        "pid": pid,
        "member": f"m{pid}",
        "partition": partition,
        "key": key,
        "seq": seq,
        "start": start,
        "end": end,
    }


def test_clean_run_has_no_violations() -> None:
    records = [rec(1, 0, "a", 0, 0.0, 1.0), rec(1, 0, "a", 1, 1.0, 2.0), rec(2, 0, "a", 2, 2.5, 3)]
    assert checker.overlaps(records) == []
    assert checker.order_violations(records) == []
    assert checker.lost([("a", 0), ("a", 1), ("a", 2)], records) == []
    assert checker.handoff_gaps(records) == [0.5]


def test_flags_an_overlap_between_processes_only() -> None:
    records = [rec(1, 0, "a", 0, 0.0, 1.0), rec(2, 0, "b", 0, 0.9, 1.5)]
    assert len(checker.overlaps(records)) == 1
    same_process = [rec(1, 0, "a", 0, 0.0, 1.0), rec(1, 0, "b", 0, 0.9, 1.5)]
    assert checker.overlaps(same_process) == []
    other_partition = [rec(1, 0, "a", 0, 0.0, 1.0), rec(2, 1, "b", 0, 0.5, 1.5)]
    assert checker.overlaps(other_partition) == []


def test_flags_an_overlap_hidden_behind_a_long_interval() -> None:
    records = [rec(1, 0, "a", 0, 0.0, 10.0), rec(1, 0, "a", 1, 1.0, 2.0), rec(2, 0, "b", 0, 5, 6)]
    assert len(checker.overlaps(records)) == 1


def test_frozen_windows_are_subtracted() -> None:
    records = [rec(1, 0, "a", 0, 0.0, 10.0), rec(2, 0, "a", 1, 2.0, 8.0)]
    assert len(checker.overlaps(records)) == 1
    assert checker.overlaps(records, {1: [(1.0, 9.0)]}) == []
    assert len(checker.overlaps(records, {1: [(3.0, 9.0)]})) == 1  # ran 2..3 alongside pid 2


def test_flags_a_gap() -> None:
    records = [rec(1, 0, "a", 0, 0, 1), rec(1, 0, "a", 2, 1, 2)]
    assert checker.lost([("a", 0), ("a", 1), ("a", 2)], records) == [("a", 1)]


def test_flags_an_order_violation_but_allows_redelivered_repeats() -> None:
    swapped = [rec(1, 0, "a", 1, 0, 1), rec(1, 0, "a", 0, 1, 2)]
    assert len(checker.order_violations(swapped)) == 1
    repeated = [
        rec(1, 0, "a", 0, 0, 1),
        rec(1, 0, "a", 1, 1, 2),
        rec(2, 0, "a", 1, 5, 6),
        rec(2, 0, "a", 2, 6, 7),
    ]
    assert checker.order_violations(repeated) == []


def test_a_redelivery_after_newer_messages_is_counted_apart_from_real_violations() -> None:
    # Given seq 1 delivered to a consumer that died unacked, redelivered after seq 2 and 3
    late = {**rec(2, 0, "a", 1, 5, 6), "redelivered": True}
    records = [rec(1, 0, "a", 0, 0, 1), rec(2, 0, "a", 2, 3, 4), rec(2, 0, "a", 3, 4, 5), late]
    # Then it is a violation, explained by the redelivery, and counted as such
    assert len(checker.order_violations(records)) == 1
    assert checker.order_violations(records, except_redelivered=True) == []
    assert checker.redelivered_out_of_order(records) == 1
    # And a late message that was not a redelivery stays a violation either way
    fresh = [*records[:3], rec(2, 0, "a", 1, 5, 6)]
    assert len(checker.order_violations(fresh, except_redelivered=True)) == 1
    assert checker.redelivered_out_of_order(fresh) == 0


def test_balance() -> None:
    assignment = {0: "a", 1: "a", 2: "b", 3: "b"}
    claims = dict(assignment)
    assert checker.balance_problems(4, ["a", "b"], assignment, claims) == []
    assert checker.balance_problems(4, ["a", "b"], {**assignment, 2: "a"}, claims)  # 3/1
    assert checker.balance_problems(4, ["a", "b"], {**assignment, 3: "gone"})  # dead owner
    assert checker.balance_problems(4, ["a", "b"], assignment, {**claims, 0: "b"})  # claim
    assert checker.balance_problems(5, ["a", "b"], {0: "a", 1: "a", 2: "b", 3: "b"})  # 4 unowned


def test_minimum_moves() -> None:
    one = dict.fromkeys(range(12), "a")
    assert checker.min_moves(12, one, ["a", "b"]) == 6
    two = {p: "a" if p < 6 else "b" for p in range(12)}
    assert checker.min_moves(12, two, ["a", "b", "c"]) == 4
    assert checker.min_moves(12, two, ["a"]) == 6  # b left: its 6 move
    three = {p: "abc"[p % 3] for p in range(12)}
    assert checker.min_moves(12, three, ["a", "b"]) == 4
    assert checker.moves(two, {**two, 0: "c", 6: "c"}) == 2
    assert checker.min_moves(7, {p: "a" if p < 4 else "b" for p in range(7)}, ["a", "b"]) == 0
