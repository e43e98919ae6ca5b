"""Pure checks of the invariants (docs/architecture.md) over handler records and group snapshots.

Used by ``partq demo`` and the invariant tests. Records are the dicts
``examples.handlers.record_handler`` writes. Every check returns a list of
violations (empty: the invariant holds), so a failing test shows what broke.

Threads. None: pure functions over records, run by tests and benchmarks after the fact.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Crash",
    "balance_problems",
    "concurrent_keys",
    "finished_beside",
    "frozen_inside",
    "handoff_gaps",
    "key_overlaps",
    "load",
    "lost",
    "min_moves",
    "moves",
    "order_violations",
    "overlaps",
    "overlaps_unexplained",
    "percentile",
    "redelivered_out_of_order",
]

Record = Mapping[str, Any]
Window = tuple[float, float]


def load(path: Path) -> list[dict[str, Any]]:
    """The records in ``path``, a line each. A last line without its newline is a record
    still being written (handlers append while it is read): left for the next read."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in whole if line.strip()]


def lost(published: Iterable[tuple[str, int]], records: Iterable[Record]) -> list[tuple[str, int]]:
    """Published (key, seq) pairs that no handler handled."""
    handled = {(r["key"], r["seq"]) for r in records}
    return sorted(set(published) - handled)


def _subtract(interval: Window, windows: Sequence[Window]) -> list[Window]:
    """The parts of ``interval`` outside every window (a frozen process does not run)."""
    parts = [interval]
    for w0, w1 in windows:
        out: list[Window] = []
        for a, b in parts:
            if b <= w0 or a >= w1:
                out.append((a, b))
                continue
            if a < w0:
                out.append((a, w0))
            if b > w1:
                out.append((w1, b))
        parts = out
    return parts


def overlaps(
    records: Iterable[Record], frozen: Mapping[int, Sequence[Window]] | None = None
) -> list[str]:
    """Moments when two processes handled one partition at once (``frozen``: pid → windows)."""
    frozen = frozen or {}
    by_partition: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for r in records:
        for a, b in _subtract((r["start"], r["end"]), frozen.get(r["pid"], ())):
            by_partition[r["partition"]].append((a, b, r["pid"]))
    problems = []
    for partition, intervals in sorted(by_partition.items()):
        intervals.sort()
        ends: dict[int, float] = {}  # pid -> latest end so far
        for a, b, pid in intervals:
            for other, end in ends.items():
                if other != pid and end > a:
                    problems.append(
                        f"partition {partition}: pid {pid} started at {a:.6f} while pid {other} "
                        f"was handling until {end:.6f} ({(end - a) * 1000:.3f} ms overlap)"
                    )
            ends[pid] = max(ends.get(pid, b), b)
    return problems


def frozen_inside(
    records: Iterable[Record], frozen: Mapping[int, Sequence[Window]]
) -> list[tuple[Record, Window]]:
    """The handler calls a process was frozen inside (begun before one of its windows,
    ended after it), each with that window."""
    return [
        (r, w)
        for r in records
        for w in frozen.get(r["pid"], ())
        if r["start"] < w[0] and w[1] < r["end"]
    ]


def finished_beside(
    records: Sequence[Record], frozen: Mapping[int, Sequence[Window]]
) -> list[Record]:
    """The handler calls a process was frozen inside whose partition another process began
    handling during that freeze: RabbitMQ noticed the freeze first (missed heartbeats) and
    served the partition on, and the call finished beside the next owner on resuming. A
    running thread cannot be stopped: a limit (docs/guarantees.md), not a fence that failed,
    for a fenced owner's partition goes to nobody else until its connection is gone."""
    starts: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in records:
        starts[r["partition"]].append((r["start"], r["pid"]))
    for found in starts.values():
        found.sort()
    beside = []
    for r, (w0, w1) in frozen_inside(records, frozen):
        found = starts[r["partition"]]
        during = found[bisect.bisect_left(found, (w0, -1)) : bisect.bisect_left(found, (w1, -1))]
        if any(pid != r["pid"] for _at, pid in during):
            beside.append(r)
    return beside


def overlaps_unexplained(
    records: Sequence[Record], frozen: Mapping[int, Sequence[Window]]
) -> list[str]:
    """:func:`overlaps` but for the calls that :func:`finished_beside` explains."""
    beside = {id(r) for r in finished_beside(records, frozen)}
    return overlaps([r for r in records if id(r) not in beside], frozen)


def fencing_regressions(records: Iterable[Record]) -> list[str]:
    """Handlings whose ``fencing_token`` (``Message.fencing_token``) does not fence: per
    partition, in the order the handlings began, a token must never fall below the greatest
    seen so far, and a process other than that token's must bring a greater one. A store
    keeping the greatest token then refuses exactly the late writes of deposed owners.
    Records without a token (0, or none: a handler that does not record it) are skipped."""
    by_partition: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for r in records:
        if token := r.get("fencing_token", 0):
            by_partition[r["partition"]].append((r["start"], token, r["pid"]))
    problems = []
    for partition, handlings in sorted(by_partition.items()):
        best, holder = 0, None
        for start, token, pid in sorted(handlings):
            if token < best or (token == best and pid != holder):
                problems.append(
                    f"partition {partition}: pid {pid} began at {start:.6f} with token "
                    f"{token}, after pid {holder}'s {best}"
                )
            elif token > best:
                best, holder = token, pid
    return problems


def _starts_during(
    intervals: list[tuple[float, float, str]],
) -> Iterator[tuple[str, str]]:
    """Each interval (start, end, name) that starts before the latest end so far, in start
    order: its name and the name of the interval that set that end."""
    latest, running = float("-inf"), ""
    for start, end, name in sorted(intervals):
        if start < latest:
            yield name, running
        if end > latest:
            latest, running = end, name


def key_overlaps(records: Iterable[Record]) -> list[str]:
    """Moments when two handlings of one key ran at once, in any processes (never allowed,
    whatever ``--concurrency``)."""
    by_key: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for r in records:
        by_key[r["key"]].append((r["start"], r["end"], r["message_id"]))
    return [
        f"key {key}: {message_id} started while {running} ran"
        for key, intervals in sorted(by_key.items())
        for message_id, running in _starts_during(intervals)
    ]


def concurrent_keys(records: Iterable[Record]) -> int:
    """Handlings that started while another key's handling of the same partition and
    process ran: above 0 only with ``--concurrency`` above 1."""
    by_owner: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for r in records:
        by_owner[(r["pid"], r["partition"])].append((r["start"], r["end"], ""))
    return sum(1 for intervals in by_owner.values() for _ in _starts_during(intervals))


@dataclass(frozen=True, slots=True)
class Crash:
    """A consumer that went away without acking what it had been delivered, at wall-clock
    time ``at``: the process ``pid`` killed, or (``pid`` None) every consumer whose
    connection a broker fault cut. ``window``: its prefetch, the most it can have held
    unacked per partition."""

    at: float
    window: int
    pid: int | None = None


def order_violations(
    records: Iterable[Record], crashes: Sequence[Crash] = (), *, repeats: bool = False
) -> list[str]:
    """Per key, first handlings (exact repeats of (key, seq) removed) must be in seq order.

    A crash is the one excuse (``crashes``): what the crashed owner held unacked is
    redelivered, after the next owner may have handled newer messages of its key. The
    records show what a handler handled, not what a consumer had been delivered, so the
    bound is the prefetch window: a first handling after a newer one of its key is
    excused only if it is a broker redelivery (its ``redelivered`` flag), started after a
    crash, of a message published before it, on a partition whose last handler before it
    was the crashed process (any, for ``pid`` None), and at most ``window`` such per crash
    and partition. Every other out-of-order first handling is reported.

    ``repeats``: report second handlings of a message as well. At-least-once lets a crash
    cause them (a message handled but not yet acked is redelivered), so one is excused
    only if it is a redelivery, after a crash, of a message the crashed process had
    started before it (any process, for ``pid`` None); it is charged to the same window
    as the late first handlings, so the two together stay within what the crashed owner
    can have had in flight on that partition. Without ``repeats`` they pass, as a fenced
    owner's or a broker fault's repeats do.
    """
    records = list(records)
    excuse = _Excuses(records, crashes)
    found = [(r["start"], _told_late(r, newer)) for r, newer in _late(records) if not excuse(r)]
    if repeats:
        found += [
            (r["start"], _told_repeat(r, first))
            for r, first in _repeats(records)
            if not excuse(r, first)
        ]
    return [text for _start, text in sorted(found)]


def _told_late(r: Record, newer: int) -> str:
    return f"key {r['key']}: seq {r['seq']} first handled at {r['start']:.6f} after {newer}"


def _told_repeat(r: Record, first: Record) -> str:
    return (
        f"key {r['key']}: seq {r['seq']} handled again at {r['start']:.6f} by pid {r['pid']} "
        f"(first by pid {first['pid']} at {first['start']:.6f})"
    )


def _repeats(records: Iterable[Record]) -> Iterator[tuple[Record, Record]]:
    """Every handling of a message after its first, with that first handling."""
    first: dict[tuple[str, int], Record] = {}
    for r in sorted(records, key=lambda r: (r["start"], r["pid"])):
        seen = first.setdefault((r["key"], r["seq"]), r)
        if seen is not r:
            yield r, seen


def _late(records: Iterable[Record]) -> Iterator[tuple[Record, int]]:
    """First handlings that came after a newer message of their key, with that newer seq."""
    first: dict[tuple[str, int], Record] = {}
    for r in records:
        k = (r["key"], r["seq"])
        seen = first.get(k)
        if seen is None or r["start"] < seen["start"]:
            first[k] = r
    by_key: dict[str, list[Record]] = defaultdict(list)
    for (key, _seq), r in first.items():
        by_key[key].append(r)
    for _key, handled in sorted(by_key.items()):
        handled.sort(key=lambda r: (r["start"], r["seq"]))
        highest = -1
        for r in handled:
            if r["seq"] < highest:
                yield r, highest
            highest = max(highest, r["seq"])


class _Excuses:
    """Which late first handlings the crashes explain, charging each to one crash's window
    on its partition (``order_violations``)."""

    def __init__(self, records: Iterable[Record], crashes: Sequence[Crash]) -> None:
        self.crashes = sorted(crashes, key=lambda c: c.at, reverse=True)  # latest first
        self.used: dict[tuple[int, int], int] = defaultdict(int)  # (crash, partition) -> n
        self.starts: dict[int, list[tuple[float, int]]] = defaultdict(list)  # partition
        if self.crashes:
            for r in records:
                self.starts[r["partition"]].append((r["start"], r["pid"]))
            for starts in self.starts.values():
                starts.sort()

    def _owned(self, partition: int, crash: Crash) -> bool:
        """Whether the crashed process was ``partition``'s last handler before the crash."""
        return crash.pid is None or self._last_handler(partition, crash.at) == crash.pid

    def _last_handler(self, partition: int, at: float) -> int | None:
        starts = self.starts[partition]
        i = bisect.bisect_right(starts, (at, math.inf)) - 1
        return starts[i][1] if i >= 0 else None

    def __call__(self, r: Record, first: Record | None = None) -> bool:
        """Whether a crash explains ``r``: a late first handling, or (``first`` given) a
        repeat of the message ``first`` handled."""
        if not r.get("redelivered"):
            return False
        published_ms = r.get("published_ms")
        partition = r["partition"]
        for n, crash in enumerate(self.crashes):
            if crash.at > r["start"]:
                continue
            if published_ms is not None and published_ms / 1000 > crash.at:
                continue  # published after the crash: the crashed owner never had it
            if first is not None and not _had(crash, first):
                continue
            if first is None and not self._owned(partition, crash):
                continue
            if self.used[(n, partition)] < crash.window:
                self.used[(n, partition)] += 1
                return True
        return False


def _had(crash: Crash, first: Record) -> bool:
    """Whether the message of the handling ``first`` was in flight in the crashed process:
    it began handling it before the crash (and had not acked it, or no repeat would come)."""
    return first["start"] < crash.at and crash.pid in (None, first["pid"])


def redelivered_out_of_order(records: Iterable[Record]) -> int:
    """How many first handlings came after a newer message of their key as a redelivery."""
    return sum(1 for r, _ in _late(records) if r.get("redelivered"))


def balance_problems(
    partitions: int,
    members: Iterable[str],
    assignment: Mapping[int, str],
    claims: Mapping[int, str] | None = None,
) -> list[str]:
    """Every partition owned by a live member, counts ⌊P/N⌋/⌈P/N⌉, claims held by the owners."""
    live = sorted(set(members))
    if not live:
        return ["no live members"]
    problems = []
    counts = dict.fromkeys(live, 0)
    for p in range(partitions):
        owner = assignment.get(p)
        if owner not in counts:
            problems.append(f"partition {p}: owner {owner!r} is not a live member")
            continue
        counts[owner] += 1
        if claims is not None and claims.get(p) != owner:
            problems.append(f"partition {p}: claimed by {claims.get(p)!r}, assigned to {owner}")
    low, high = partitions // len(live), math.ceil(partitions / len(live))
    for member, count in counts.items():
        if not low <= count <= high:
            problems.append(f"{member} owns {count} partitions, not {low}..{high}")
    return problems


def moves(before: Mapping[int, str], after: Mapping[int, str]) -> int:
    return sum(1 for p in set(before) | set(after) if before.get(p) != after.get(p))


def min_moves(partitions: int, before: Mapping[int, str], members: Iterable[str]) -> int:
    """The fewest owner changes from ``before`` to any balanced assignment over ``members``."""
    live = sorted(set(members))
    n = len(live)
    low, extra = divmod(partitions, n)
    held = sorted(
        (sum(1 for p in range(partitions) if before.get(p) == m) for m in live), reverse=True
    )
    kept = sum(min(c, low + (1 if i < extra else 0)) for i, c in enumerate(held))
    return partitions - kept


def handoff_gaps(records: Iterable[Record]) -> list[float]:
    """Per partition, seconds from one process's last handling to the next process's first."""
    by_partition: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_partition[r["partition"]].append(r)
    gaps = []
    for rs in by_partition.values():
        rs.sort(key=lambda r: r["start"])
        for prev, nxt in itertools.pairwise(rs):
            if nxt["pid"] != prev["pid"]:
                gaps.append(nxt["start"] - prev["end"])
    return gaps


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
