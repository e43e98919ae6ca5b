"""Pure checks of the invariants (docs/architecture.md) over handler records and group snapshots.

Used by ``partq demo`` and the invariant tests. Records are the dicts
``consumers.examples.record_handler`` writes. Every check returns a list of
violations (empty: the invariant holds), so a failing test shows what broke.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "balance_problems",
    "handoff_gaps",
    "load",
    "lost",
    "min_moves",
    "moves",
    "order_violations",
    "overlaps",
    "percentile",
]

Record = Mapping[str, Any]
Window = tuple[float, float]


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def order_violations(records: Iterable[Record], *, except_redelivered: bool = False) -> list[str]:
    """Per key, first handlings (exact repeats of (key, seq) removed) must be in seq order.

    ``except_redelivered``: a message whose first handling was a broker redelivery (it was
    delivered to a consumer that then crashed or froze, unacked) may come after newer
    messages of its key; such violations are left out (count them with
    :func:`redelivered_out_of_order`). Every other violation is reported.
    """
    first: dict[tuple[str, int], tuple[float, bool]] = {}
    for r in records:
        k = (r["key"], r["seq"])
        seen = first.get(k)
        if seen is None or r["start"] < seen[0]:
            first[k] = (r["start"], bool(r.get("redelivered", False)))
    by_key: dict[str, list[tuple[float, int, bool]]] = defaultdict(list)
    for (key, seq), (start, redelivered) in first.items():
        by_key[key].append((start, seq, redelivered))
    problems = []
    for key, handled in sorted(by_key.items()):
        handled.sort()
        highest = -1
        for at, seq, redelivered in handled:
            if seq < highest and not (except_redelivered and redelivered):
                problems.append(f"key {key}: seq {seq} first handled at {at:.6f} after {highest}")
            highest = max(highest, seq)
    return problems


def redelivered_out_of_order(records: Iterable[Record]) -> int:
    """How many first handlings came after a newer message of their key as a redelivery."""
    records = list(records)
    return len(order_violations(records)) - len(order_violations(records, except_redelivered=True))


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
