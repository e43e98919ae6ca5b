"""Check a record of handled messages against partq's invariants (pure; used by the demo).

A record is one dict per handling: member, partition, key, body (``"<seq>"``),
start, end. ``published`` maps key → the sequence numbers published for it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Audit", "audit"]


@dataclass(frozen=True)
class Audit:
    handled: int
    unique: int
    lost: list[tuple[str, int]] = field(default_factory=list)
    duplicates: int = 0
    order_violations: list[tuple[str, int, int]] = field(default_factory=list)
    overlaps: list[tuple[int, str, str]] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # per owner change of a partition, seconds

    @property
    def ok(self) -> bool:
        return not (self.lost or self.order_violations or self.overlaps)


def audit(records: Iterable[Mapping[str, Any]], published: Mapping[str, list[int]]) -> Audit:
    rows = sorted(records, key=lambda r: r["start"])
    seen: set[tuple[str, int]] = set()
    last: dict[str, int] = {}
    violations: list[tuple[str, int, int]] = []
    duplicates = 0
    for r in rows:
        key, seq = r["key"], int(r["body"])
        if (key, seq) in seen:
            duplicates += 1
            continue
        seen.add((key, seq))
        if key in last and seq < last[key]:
            violations.append((key, last[key], seq))
        last[key] = max(seq, last.get(key, seq))
    lost = sorted((k, s) for k, seqs in published.items() for s in seqs if (k, s) not in seen)
    by_partition: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_partition[int(r["partition"])].append(r)
    overlaps: list[tuple[int, str, str]] = []
    gaps: list[float] = []
    for partition, handled in sorted(by_partition.items()):
        latest_end: dict[str, float] = {}
        previous = None
        for r in handled:
            for member, end in latest_end.items():
                if member != r["member"] and end > r["start"]:
                    overlaps.append((partition, member, r["member"]))
            if previous is not None and previous["member"] != r["member"]:
                gaps.append(r["start"] - previous["end"])
            latest_end[r["member"]] = max(latest_end.get(r["member"], 0.0), r["end"])
            previous = r
    return Audit(len(rows), len(seen), lost, duplicates, violations, overlaps, gaps)
