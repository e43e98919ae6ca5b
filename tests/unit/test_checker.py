"""The invariant checker on synthetic records: it must flag what it exists to catch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples import audit as checker


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


def late(pid: int, seq: int, start: float, published: float = 0.5) -> dict[str, Any]:
    """A redelivery of ``seq`` on partition 0 (key "a"), published at ``published`` s."""
    return {**rec(pid, 0, "a", seq, start, start + 0.1), "redelivered": True,
            "published_ms": int(published * 1000)}  # fmt: skip


def test_a_redelivery_after_newer_messages_is_excused_only_by_a_crash_of_its_owner() -> None:
    # Given pid 1 owning partition 0, killed at 2.0 holding seq 1 unacked; pid 2 handles
    # seq 2 and 3, then the redelivered seq 1
    records = [rec(1, 0, "a", 0, 0, 1), rec(2, 0, "a", 2, 3, 4), rec(2, 0, "a", 3, 4, 5)]
    records.append(late(2, 1, 5))
    killed = checker.Crash(at=2.0, window=10, pid=1)
    # Then it is a violation unless the crash explains it, and counted as a redelivery
    assert len(checker.order_violations(records)) == 1
    assert checker.order_violations(records, [killed]) == []
    assert checker.redelivered_out_of_order(records) == 1
    # And not if the killed process was not the partition's owner
    assert len(checker.order_violations(records, [checker.Crash(2.0, 10, pid=7)])) == 1
    # nor if it was handled before the crash, or published after it
    assert len(checker.order_violations(records, [checker.Crash(5.5, 10, pid=1)])) == 1
    assert len(checker.order_violations([*records[:3], late(2, 1, 5, 2.5)], [killed])) == 1
    # And a late message that was not a redelivery stays a violation either way
    fresh = [*records[:3], rec(2, 0, "a", 1, 5, 6)]
    assert len(checker.order_violations(fresh, [killed])) == 1
    assert checker.redelivered_out_of_order(fresh) == 0


def test_a_crash_excuses_at_most_a_prefetch_window_per_partition() -> None:
    # Given pid 1 killed at 2.0 and 5 of its messages redelivered after newer ones
    records = [rec(1, 0, "a", 0, 0, 1), rec(2, 0, "a", 10, 3, 4)]
    records += [late(2, seq, 5 + seq) for seq in range(1, 6)]
    # Then a window of 3 excuses 3 of them, a window of 5 all; a broker fault (no pid)
    # cuts whoever owned the partition
    assert len(checker.order_violations(records, [checker.Crash(2.0, 3, pid=1)])) == 2
    assert checker.order_violations(records, [checker.Crash(2.0, 5, pid=1)]) == []
    assert checker.order_violations(records, [checker.Crash(2.0, 5)]) == []
    # And two crashes each have their own window
    two = [checker.Crash(2.0, 3, pid=1), checker.Crash(2.5, 2, pid=1)]
    assert checker.order_violations(records, two) == []


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


def test_a_repeat_is_excused_only_as_a_crash_redelivery_of_what_the_owner_had_begun() -> None:
    # Given pid 1 handling seq 1 from 1.0 (not acked when killed at 2.0), and pid 2 handling
    # it again as a redelivery, then seq 2
    records = [rec(1, 0, "a", 0, 0, 1), rec(1, 0, "a", 1, 1, 1.5)]
    records += [late(2, 1, 3), rec(2, 0, "a", 2, 4, 5)]
    killed = checker.Crash(at=2.0, window=10, pid=1)
    # Then without repeats checked, or with the crash, nothing is reported
    assert checker.order_violations(records) == []
    assert checker.order_violations(records, [killed], repeats=True) == []
    # But with no crash, a crash of another process, or one before pid 1 began it, the
    # repeat is reported
    assert len(checker.order_violations(records, repeats=True)) == 1
    assert len(checker.order_violations(records, [checker.Crash(2.0, 10, 7)], repeats=True)) == 1
    assert len(checker.order_violations(records, [checker.Crash(0.5, 10, 1)], repeats=True)) == 1
    # And a repeat that is not a broker redelivery is reported whatever crashed
    again = [*records[:2], rec(2, 0, "a", 1, 3, 3.1)]
    assert len(checker.order_violations(again, [killed], repeats=True)) == 1


def test_repeats_and_late_first_handlings_share_one_window() -> None:
    # Given pid 1 killed at 2.0 after beginning seq 1..3 (unacked) while seq 4 and 5 waited;
    # pid 2 handles seq 6, then seq 4 and 5 late, then seq 1..3 again
    records = [rec(1, 0, "a", seq, seq * 0.1, seq * 0.1 + 0.05) for seq in range(1, 4)]
    records += [rec(2, 0, "a", 6, 3, 3.1), late(2, 4, 4), late(2, 5, 4.2)]
    records += [late(2, seq, 5 + seq) for seq in range(1, 4)]
    # Then a window of 5 (what pid 1 can have held) explains all five, a window of 4 not
    assert checker.order_violations(records, [checker.Crash(2.0, 5, 1)], repeats=True) == []
    assert len(checker.order_violations(records, [checker.Crash(2.0, 4, 1)], repeats=True)) == 1


def test_a_record_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    # A handler appends its line while the test reads the file: seen, a half line
    # (CI, 2026-11-26) failed a test with a JSONDecodeError
    record = tmp_path / "records.jsonl"
    record.write_text('{"key": "a", "seq": 0}\n{"key": "a", "se')
    assert checker.load(record) == [{"key": "a", "seq": 0}]
    with record.open("a") as out:
        out.write('q": 1}\n')
    assert checker.load(record) == [{"key": "a", "seq": 0}, {"key": "a", "seq": 1}]


def fenced(pid: int, partition: int, start: float, token: int) -> dict[str, Any]:
    return {**rec(pid, partition, "a", 0, start, start + 0.5), "fencing_token": token}


def test_fencing_tokens_must_grow_at_each_change_of_process() -> None:
    # a zombie's call begun before the next owner's, with a smaller token: fenced
    zombie = [fenced(2, 0, 0.0, 5), fenced(1, 0, 1.0, 9), fenced(1, 0, 2.0, 9), fenced(2, 0, 3, 12)]
    assert checker.fencing_regressions(zombie) == []
    # the same token in two processes, or a token below one seen before: not fenced
    shared = [fenced(2, 0, 0.0, 5), fenced(1, 0, 1.0, 5)]
    assert len(checker.fencing_regressions(shared)) == 1
    stale = [fenced(1, 0, 0.0, 9), fenced(2, 0, 1.0, 5)]
    assert len(checker.fencing_regressions(stale)) == 1
    # partitions are fenced apart
    assert checker.fencing_regressions([fenced(1, 0, 0.0, 9), fenced(2, 1, 1.0, 5)]) == []
