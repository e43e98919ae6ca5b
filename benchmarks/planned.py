# ruff: noqa: E501  (report lines)
"""Planned handoff gap by kind of move: joins, operator moves, drains, SIGTERM leaves (issue 12, goal 2).

    .venv/bin/python -m benchmarks.planned [--rounds 2] [--rate 2000] [--queue-type quorum] [--concurrency 1]
        [--rabbitmq machine|private|4.0.5] [--handoff drain|auto|both] [--standby | --no-standby]
        [--handler-delay-ms 0] [--async-handler]

Per round: a fresh P = 12 stream, a coordinator (``--settle 1``), the SDK publishing 100
keys at ``--rate``, consumers recording with the product's recorder
(``benchmarks.recording:record``). Phases, each waiting until the group is balanced and
every claim is held by its assigned owner:

- **join**: c1 alone, then c2, c3 and c4 join one by one (1 → 4);
- **move**: 12 operator moves (``Group.request(Move(p, to))``, what ``partq move`` stores),
  each partition to the next member in turn, one at a time; the leader's own rebalance
  that follows each (it moves one partition off the member that got one too many) counts
  here too;
- **drain**: ``Drain("c4")`` (what ``partq drain`` stores) until c4 owns nothing; then the
  request is cleared and a ``Rebalance`` gives c4 its share back (**rebalance**);
- **leave**: SIGTERM c4, c3, c2 one by one (4 → 1; the stop is announced).

Gap = one process's last handling of a partition → the next process's first
(``examples.audit.handoff_gaps``' rule), each counted in the phase in which the old
owner's last handling fell. Prints a Markdown table with the machine's load and the share
of all cores busy in each round's phases (``benchmarks.cpu``), with a warning over
:data:`SATURATED`: there the gaps are a saturated machine's, not an idle one's.

``--handoff`` sets every consumer's ``PARTQ_HANDOFF`` (``auto``: by consumer priority where
the broker switches, RabbitMQ 4 quorum queues; ``consumers/state/priority.py``); ``both`` runs
each round twice, drain then auto, on the same broker, and prints a table for each.
``--rabbitmq 4.0.5`` runs on a private 4.0.5 node (the cached tree; tests/rabbit.py),
``--rabbitmq private`` on a fresh private node of the machine's RabbitMQ (a broker whose
quorum queues carry no earlier runs' log).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import signal
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from partq.coordinator.store.codec import Drain, Move, Rebalance
from partq.coordinator.store.group import Group

from benchmarks import groups
from benchmarks.cpu import busy_share, jiffies
from benchmarks.groups import Bench, Run, log
from examples import audit
from partq.kernel.local import LocalEtcd

KINDS = ("join", "move", "drain", "rebalance", "leave")


def gaps_at(records: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(old owner's last handling ends, gap, partition) for each change of process."""
    return [(prev["end"], nxt["start"] - prev["end"], p) for prev, nxt, p in changes(records)]


def changes(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any], int]]:
    """(old owner's last record, next owner's first, partition) for each change of process."""
    by_partition: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_partition[r["partition"]].append(r)
    out = []
    for p, rs in sorted(by_partition.items()):
        rs.sort(key=lambda r: r["start"])
        for prev, nxt in itertools.pairwise(rs):
            if nxt["pid"] != prev["pid"]:
                out.append((prev, nxt, p))
    return out


SEGMENTS = (
    "last handling -> released",
    "released -> heir claims (or is granted)",
    "claims -> subscribing",
    "subscribing -> active",
    "active -> first handling",
)
_RELEASED = ("every delivery handled: released", "drained and released")


def _log_times(path: Path) -> dict[int, list[tuple[float, str]]]:
    """A consumer's ``--debug`` JSON log: per partition, (time, message) in order."""
    out: dict[int, list[tuple[float, str]]] = defaultdict(list)
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError):
            doc = json.loads(line)
            m = re.match(r"partition (\d+): (.*)", doc["message"])
            if m:
                t = datetime.fromisoformat(doc["time"]).timestamp()
                out[int(m.group(1))].append((t, m.group(2)))
    return out


def segments(workdir: Path, stream: str, records: list[dict[str, Any]]) -> list[list[float]]:
    """Each change of owner split into :data:`SEGMENTS` (seconds) from both members' debug
    logs (millisecond stamps); a change whose lines are not all there is left out."""
    logs: dict[str, dict[int, list[tuple[float, str]]]] = {}

    def lines(member: str, p: int) -> list[tuple[float, str]]:
        if member not in logs:
            logs[member] = _log_times(workdir / f"{stream}-{member}.log")
        return logs[member].get(p, [])

    def first(member: str, p: int, after: float, *texts: str) -> float | None:
        for t, msg in lines(member, p):
            if t >= after - 0.001 and any(x in msg for x in texts):
                return t
        return None

    out = []
    for prev, nxt, p in changes(records):
        released = first(prev["member"], p, prev["end"], *_RELEASED)
        # the heir either claims (the claim was deleted) or was handed it (granted)
        claiming = released and first(nxt["member"], p, prev["end"], "-> claiming", "on granted")
        subscribing = claiming and first(nxt["member"], p, claiming, "-> subscribing")
        active = subscribing and first(nxt["member"], p, subscribing, "subscribing -> active")
        if released is None or not claiming or not subscribing or not active:
            continue
        marks = [prev["end"], released, claiming, subscribing, active, nxt["start"]]
        out.append([max(0.0, b - a) for a, b in itertools.pairwise(marks)])
    return out


class Phases:
    def __init__(self) -> None:
        self.windows: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def phase(self, kind: str) -> Any:
        t0 = time.time()
        yield
        self.windows.append((kind, t0, time.time()))

    def kind(self, t: float) -> str | None:
        for kind, t0, t1 in self.windows:
            if t0 <= t <= t1:
                return kind
        return None


def balanced(b: Bench, run: Run, members: list[str], timeout: float = 60) -> None:
    if b.settled(run.spec, members, timeout) is None:
        raise RuntimeError(f"{members} never settled")


def done(b: Bench, run: Run, request: str, timeout: float = 30) -> None:
    """Wait until the leader has cleared the operator request ``request``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if request not in b.snapshot(run.spec).requests:
                return
        time.sleep(0.02)
    raise RuntimeError(f"the leader never took {request}")


def one(
    b: Bench,
    queue_type: str,
    rate: float,
    dwell: float,
    concurrency: int = 1,
    amqp: str = groups.AMQP,
    handoff: str = "drain",
    coordinator_args: tuple[str, ...] = (),
    delay_ms: float = 0.0,
    async_handler: bool = False,
) -> dict[str, Any]:
    phases = Phases()
    cpu = jiffies()
    # each consumer's options: its environment, and the handler (``benchmarks.groups.Bench``)
    env = {"PARTQ_CONCURRENCY": str(concurrency), "PARTQ_HANDOFF": handoff}
    env["PARTQ_RECORD_SLEEP"] = str(delay_ms / 1000)  # the recorder's handler work
    if async_handler:
        env["handler"] = "benchmarks.recording:record_async"  # not an env variable: the option
    run = Run(
        b, "planned", queue_type, ["c1"], rate, amqp=amqp, coordinator_args=coordinator_args,
        **env,
    )  # fmt: skip
    group = Group(b.registry.client, b.registry.where, run.spec.name, report=False)
    time.sleep(dwell)
    members = ["c1"]
    with phases.phase("join"):
        for n in (2, 3, 4):
            members.append(f"c{n}")
            run.add(f"c{n}")
            balanced(b, run, members)
            time.sleep(dwell)
    with phases.phase("move"):
        for p in range(run.spec.partitions):
            owner = b.snapshot(run.spec).assignment[p]
            to = members[(members.index(owner) + 1) % len(members)]
            group.request(Move(p, to))
            done(b, run, Move(p, to).name)  # the leader took it (and may rebalance after)
            balanced(b, run, members)
            time.sleep(0.3)
        time.sleep(dwell)
    with phases.phase("drain"):
        group.request(Drain("c4"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = b.snapshot(run.spec)
            if "c4" not in s.assignment.values() and all(
                p in s.claims and s.claims[p].member == o for p, o in s.assignment.items()
            ):
                break
            time.sleep(0.05)
        time.sleep(dwell)
    with phases.phase("rebalance"):
        group.clear_request(Drain("c4").name)
        group.request(Rebalance())
        done(b, run, Rebalance().name)
        balanced(b, run, members)
        time.sleep(dwell)
    with phases.phase("leave"):
        for n in (4, 3, 2):
            proc = run.procs.pop(f"c{n}")
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            members.remove(f"c{n}")
            balanced(b, run, members)
            time.sleep(dwell)
    busy = busy_share(cpu, jiffies())  # the phases' share, not the audit's after them
    records, summary = run.finish()
    by_kind: dict[str, list[float]] = defaultdict(list)
    for at, gap, _p in gaps_at(records):
        by_kind[phases.kind(at) or "other"].append(gap)
    split = segments(b.dir, run.spec.name, records)
    return summary | {"gaps": dict(by_kind), "segments": split, "busy": busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--dwell", type=float, default=2.0)
    ap.add_argument("--queue-type", default="quorum", choices=("quorum", "classic"))
    ap.add_argument("--concurrency", type=int, default=1, help="every consumer's --concurrency")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--keep", type=Path, help="keep the logs and records in this directory")
    ap.add_argument("--debug", action="store_true", help="debug logs of every partq process")
    ap.add_argument(
        "--rabbitmq",
        choices=("machine", "private", "4.0.5"),
        default="machine",
        help="the machine's node, a fresh private node of the machine's RabbitMQ, or 4.0.5",
    )
    ap.add_argument("--handoff", choices=("drain", "auto", "both"), default="drain")
    ap.add_argument(
        "--standby",
        action=argparse.BooleanOptionalAction,
        help="the coordinator's --standby / --no-standby (default: the product's)",
    )
    ap.add_argument("--handler-delay-ms", type=float, default=0.0, help="handler work per message")
    ap.add_argument(
        "--async-handler", action="store_true", help="an async def recorder (awaits the delay)"
    )
    args = ap.parse_args(argv)
    standby = () if args.standby is None else ("--standby" if args.standby else "--no-standby",)
    if args.debug:
        groups.PARTQ.append("--debug")  # before the subcommand
    load_before = os.getloadavg()
    handoffs = ("drain", "auto") if args.handoff == "both" else (args.handoff,)
    results: dict[str, list[dict[str, Any]]] = {h: [] for h in handoffs}
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd())
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        amqp, version = groups.AMQP, "the machine's"
        if args.rabbitmq != "machine":
            from benchmarks.sac_priority import broker  # starts a private node

            amqp, version = stack.enter_context(broker(args.rabbitmq))
            version += " (a fresh private node)"
        workdir = Path(tmp) if args.keep is None else args.keep
        workdir.mkdir(parents=True, exist_ok=True)
        b = Bench(etcd, workdir)
        try:
            for r in range(args.rounds):
                for handoff in handoffs:
                    res = one(
                        b, args.queue_type, args.rate, args.dwell, args.concurrency, amqp,
                        handoff, standby, args.handler_delay_ms, args.async_handler,
                    )  # fmt: skip
                    results[handoff].append(res)
                    summary = {k: len(v) for k, v in res["gaps"].items()}
                    log(
                        f"round {r + 1} ({handoff}): moves {summary}, order {res['order']}, "
                        f"drained {res['drained']}, cores {res['busy']:.0%} busy"
                    )
        finally:
            b.stop(b.procs)
    load_after = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps({"load": [load_before, load_after], "results": results}))
    for handoff in handoffs:
        print(
            f"\nRabbitMQ {version}, queue type {args.queue_type}, --handoff {handoff}, rate {args.rate:.0f} msg/s, "
            f"P = 12, rounds {args.rounds}, --concurrency {args.concurrency}, "
            f"handler {'async ' if args.async_handler else ''}{args.handler_delay_ms:g} ms, "
            f"coordinator {' '.join(standby) or 'with the default standbys'}, "
            f"load average {' '.join(f'{x:.2f}' for x in load_before)} → {' '.join(f'{x:.2f}' for x in load_after)}, "
            f"{busy(results[handoff])}\n"
        )
        table(results[handoff])
    return 0


# All cores busier than this over a round: the gaps are a saturated machine's, where every
# hop of a handoff waits for a core (and a Python thread for the GIL its holder keeps while
# descheduled), not the product's on an idle machine.
SATURATED = 0.85


def busy(results: list[dict[str, Any]]) -> str:
    """The rounds' share of all cores busy, and a warning where that is a saturated machine."""
    shares = [res["busy"] for res in results]
    text = f"all {os.cpu_count()} cores busy {'/'.join(f'{x:.0%}' for x in shares)} (by round)"
    if max(shares, default=0.0) > SATURATED:
        text += (
            f"\n\n**The cores were over {SATURATED:.0%} busy**: these gaps are a saturated "
            "machine's (each hop waits for a core), not an idle one's; compare trees only "
            "within one run of this kind, on the same machine."
        )
    return text


def table(results: list[dict[str, Any]]) -> None:
    """The gap table of one ``--handoff``'s rounds, the totals, and the segments."""
    print("| planned move | moves | gap p50 | gap p99 | max |")
    print("|---|---:|---:|---:|---:|")
    every: list[float] = []
    for kind in (*KINDS, "other"):
        gaps = [g for res in results for g in res["gaps"].get(kind, [])]
        if not gaps:
            continue
        every += gaps if kind != "other" else []
        print(
            f"| {kind} | {len(gaps)} | {audit.percentile(gaps, 50) * 1000:.0f} ms | "
            f"{audit.percentile(gaps, 99) * 1000:.0f} ms | {max(gaps, default=math.nan) * 1000:.0f} ms |"
        )
    print(
        f"| **all planned** | {len(every)} | {audit.percentile(every, 50) * 1000:.0f} ms | "
        f"{audit.percentile(every, 99) * 1000:.0f} ms | {max(every, default=math.nan) * 1000:.0f} ms |"
    )
    totals = {
        k: sum(res["order"][k] for res in results)
        for k in ("violations", "lost", "duplicates", "overlaps", "redelivered")
    }
    print(f"\npublished {sum(res['published'] for res in results):,}; {totals}")
    split = [s for res in results for s in res["segments"]]
    if split:  # only --debug logs have the lines
        print(f"\n| segment ({len(split)} moves with every line) | p50 | p90 | p99 | max |")
        print("|---|---:|---:|---:|---:|")
        for i, name in enumerate(SEGMENTS):
            xs = [s[i] for s in split]
            cells = " | ".join(f"{audit.percentile(xs, q) * 1000:.0f} ms" for q in (50, 90, 99))
            print(f"| {name} | {cells} | {max(xs) * 1000:.0f} ms |")


if __name__ == "__main__":
    raise SystemExit(main())
