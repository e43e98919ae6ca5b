"""The soak's checker: pure functions over handler records, the nemesis's faults and samples.

Records are the lines ``examples.handlers.record_handler`` writes (``examples.audit``
reads them); faults are :class:`Fault` values. Nothing here does I/O, so a unit test can
drive it with made-up records.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from examples import audit

__all__ = ["IDLE_LIMIT", "Fault", "Sample", "Stall", "Verdict", "judge", "stalls"]

Record = Mapping[str, Any]

# A consumer's prefetch (tests/integration/groups/harness.py PREFETCH): the most a crashed
# owner can have held unacked per partition.
WINDOW = 100
# How long after a fault a partition's handling gap is charged to it (cut at the next fault).
PAUSE_HORIZON = 30.0
# The longest a partition may hand nothing to its handlers while a message waits in it. The
# worst stall the faults explain: a freeze of up to 12 s of an owner that RabbitMQ still
# counts as live (heartbeat = TTL 5 s), the next owner's takeover (a lease TTL, the
# coordinator's settle, a subscribe), and a node kill stacked on it (reconnect and the
# queue's leader election, about 5 s). The 55 s stall of a dead I/O thread (fixed in
# b977b88) was over it; every other stall seen in 18-minute soaks was under 26 s.
IDLE_LIMIT = 30.0
# Fault kinds that drop a consumer's connection without acking what it held.
CONSUMER_CRASH = "consumer-kill"
BROKER_CRASH = "rabbit-kill"
FREEZE = "consumer-stop"


@dataclass(frozen=True)
class Fault:
    """One nemesis action at wall-clock ``at``; ``pid`` the process it hit (if one),
    ``until`` when it ended (a freeze's SIGCONT), ``ok`` False if the action failed."""

    at: float
    kind: str
    target: str
    pid: int | None = None
    until: float | None = None
    ok: bool = True
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    """A process's resident memory (KiB) at wall-clock ``at``."""

    at: float
    label: str
    pid: int
    rss_kib: int


@dataclass(frozen=True)
class Verdict:
    confirmed: int
    handled: int
    redelivered: int  # handlings of a message the broker flagged redelivered
    lost: int
    lost_examples: list[str]
    duplicates: dict[str, int]  # by cause: the latest fault between the two handlings
    order_raw: int
    order_unexplained: int
    order_examples: list[str]
    overlaps_raw: int
    overlaps: int  # not explained by a call a process was frozen inside (audit.finished_beside)
    overlap_examples: list[str]
    pauses: dict[str, dict[str, float]]  # fault kind -> n, p50, p99, max (seconds)
    memory: dict[str, dict[str, float]]  # process label -> first, max, last (MiB)
    faults: dict[str, int]  # kind -> how many
    # handlings whose fencing token did not fence (audit.fencing_regressions), and examples
    fencing: int = 0
    fencing_examples: list[str] = field(default_factory=list)
    # stalls over IDLE_LIMIT (a partition idle while a message waited in it), the longest
    # stall of the run (s), and examples
    stalls: int = 0
    longest_stall: float = 0.0
    stall_examples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.lost == 0 and self.order_unexplained == 0 and self.overlaps == 0
            and self.fencing == 0 and self.stalls == 0
        )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def crashes(faults: Iterable[Fault]) -> list[audit.Crash]:
    """The faults that excuse late redeliveries: a consumer killed -9 (its pid), a RabbitMQ
    node killed (every consumer connected to it: no pid)."""
    found = []
    for f in faults:
        if f.ok and f.kind == CONSUMER_CRASH:
            found.append(audit.Crash(f.at, WINDOW, f.pid))
        elif f.ok and f.kind == BROKER_CRASH:
            found.append(audit.Crash(f.at, WINDOW))
    return found


def frozen_windows(faults: Iterable[Fault]) -> dict[int, list[tuple[float, float]]]:
    """pid -> the windows it was stopped (SIGSTOP … SIGCONT): a stopped handler runs nothing."""
    windows: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for f in faults:
        if f.ok and f.kind == FREEZE and f.pid is not None and f.until is not None:
            windows[f.pid].append((f.at, f.until))
    return dict(windows)


def duplicates_by_cause(records: Sequence[Record], faults: Sequence[Fault]) -> dict[str, int]:
    """Each handling of a (key, seq) after its first, charged to the latest fault in the
    ``PAUSE_HORIZON`` s before it ("none" if there was none), and split by how it came: a
    broker redelivery (flagged), or a second copy of the message in the queue (not flagged:
    a publish the broker took twice)."""
    times = sorted((f.at, f.kind) for f in faults if f.ok)
    starts = [t for t, _ in times]
    causes: Counter[str] = Counter()
    seen: set[tuple[str, int]] = set()
    for r in sorted(records, key=lambda r: r["start"]):
        k = (r["key"], r["seq"])
        if k not in seen:
            seen.add(k)
            continue
        i = bisect.bisect_right(starts, r["start"]) - 1
        near = i >= 0 and r["start"] - times[i][0] <= PAUSE_HORIZON
        how = "redelivered" if r.get("redelivered") else "second copy"
        causes[f"{times[i][1] if near else 'none'} ({how})"] += 1
    return dict(sorted(causes.items()))


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": audit.percentile(values, 50),
        "p99": audit.percentile(values, 99),
        "max": max(values) if values else math.nan,
    }


def _handlings(records: Iterable[Record]) -> dict[int, list[Record]]:
    """Each partition's handlings in order of start (then end)."""
    by_partition: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_partition[r["partition"]].append(r)
    return {p: sorted(rs, key=lambda r: (r["start"], r["end"])) for p, rs in by_partition.items()}


def _gaps(handled: Sequence[Record]) -> list[tuple[float, float, int]]:
    """The gaps between ``handled`` (one partition's, in order): (the latest end so far, the
    next start, that handling's index), wherever nothing was being handled."""
    found, reach = [], handled[0]["end"]
    for i in range(1, len(handled)):
        if handled[i]["start"] > reach:
            found.append((reach, handled[i]["start"], i))
        reach = max(reach, handled[i]["end"])
    return found


def pauses(records: Sequence[Record], faults: Sequence[Fault]) -> dict[str, dict[str, float]]:
    """Per fault kind, over (fault, partition): the longest gap between consecutive
    handlings of the partition (one's end to the next one's start) that reaches into the
    span from the fault to the next fault (at most ``PAUSE_HORIZON`` s)."""
    gaps = {p: [(a, b) for a, b, _ in _gaps(handled)] for p, handled in _handlings(records).items()}
    ordered = sorted((f for f in faults if f.ok), key=lambda f: f.at)
    charged: dict[str, list[float]] = defaultdict(list)
    for n, fault in enumerate(ordered):
        horizon = fault.at + PAUSE_HORIZON
        if n + 1 < len(ordered):
            horizon = min(horizon, max(ordered[n + 1].at, fault.at + 1.0))
        for found in gaps.values():
            longest = max((b - a for a, b in found if b > fault.at and a < horizon), default=0.0)
            charged[fault.kind].append(longest)
    return {kind: _quantiles(values) for kind, values in sorted(charged.items())}


@dataclass(frozen=True)
class Stall:
    """Partition ``partition`` handled nothing from ``since`` to ``until`` (wall clock)
    while a message it handled at ``until`` or later had been published by ``since``."""

    partition: int
    since: float
    until: float

    @property
    def seconds(self) -> float:
        return self.until - self.since

    def __str__(self) -> str:
        return f"p{self.partition}: {self.seconds:.1f} s idle from {self.since:.3f}"


def stalls(records: Sequence[Record]) -> list[Stall]:
    """Per partition, every gap between handlings (one's end to the next one's start) that
    a waiting message reaches into: counted from the later of the gap's start and the
    earliest publish among the messages handled after it. Records without a publish time
    (not partq's producer) tell nothing of waiting and are left out. Longest first."""
    found = []
    for p, handled in _handlings(records).items():
        published = [math.inf] * (len(handled) + 1)  # the earliest publish from i on
        for i in range(len(handled) - 1, -1, -1):
            ms = handled[i].get("published_ms")
            published[i] = min(published[i + 1], math.inf if ms is None else ms / 1000)
        for reach, start, i in _gaps(handled):
            since = max(reach, published[i])
            if start > since:
                found.append(Stall(p, since, start))
    return sorted(found, key=lambda s: (-s.seconds, s.partition, s.since))


def memory(samples: Iterable[Sample]) -> dict[str, dict[str, float]]:
    """Per process (label and pid): its first, largest and last RSS in MiB."""
    series: dict[str, list[int]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.at):
        series[f"{s.label} ({s.pid})"].append(s.rss_kib)
    return {
        name: {
            "first": kib[0] / 1024,
            "max": max(kib) / 1024,
            "last": kib[-1] / 1024,
            "samples": len(kib),
        }
        for name, kib in sorted(series.items())
    }


def judge(
    records: Sequence[Record],
    confirmed: Iterable[tuple[str, int]],
    faults: Sequence[Fault],
    samples: Iterable[Sample] = (),
    idle_limit: float = IDLE_LIMIT,
) -> Verdict:
    confirmed = set(confirmed)
    missing = audit.lost(confirmed, records)
    raw = audit.order_violations(records)
    unexplained = audit.order_violations(records, crashes(faults))
    frozen = frozen_windows(faults)
    overlapping_raw = audit.overlaps(records, frozen)
    overlapping = audit.overlaps_unexplained(records, frozen) if overlapping_raw else []
    unfenced = audit.fencing_regressions(records)
    idle = stalls(records)
    over = [s for s in idle if s.seconds > idle_limit]
    return Verdict(
        confirmed=len(confirmed),
        handled=len(records),
        redelivered=sum(1 for r in records if r.get("redelivered")),
        lost=len(missing),
        lost_examples=[f"{k}:{s}" for k, s in missing[:10]],
        duplicates=duplicates_by_cause(records, faults),
        order_raw=len(raw),
        order_unexplained=len(unexplained),
        order_examples=unexplained[:10],
        overlaps_raw=len(overlapping_raw),
        overlaps=len(overlapping),
        overlap_examples=overlapping[:10],
        pauses=pauses(records, faults),
        memory=memory(samples),
        faults=dict(sorted(Counter(f.kind for f in faults if f.ok).items())),
        fencing=len(unfenced),
        fencing_examples=unfenced[:10],
        stalls=len(over),
        longest_stall=idle[0].seconds if idle else 0.0,
        stall_examples=[str(s) for s in over[:10]],
    )
