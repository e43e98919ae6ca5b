# ruff: noqa: E501  (report lines)
"""Lag with Zipf-skewed keys: lag-aware assignment (``--balance load``) against count-based.

    .venv/bin/python -m benchmarks.lag [--rounds 2] [--rate 600] [--warmup 45] [--seconds 60] [--cost 0.003]

Per round and mode: a fresh P = 12 quorum stream, a coordinator (``--balance count``, or
``--balance load --load-interval 5 --load-moves 2``), consumers c1-c3 whose handler has a
fixed capacity per member (:func:`capacity_handler`: one lock per process, ``--cost``
seconds of sleep per message, so a member handles about 1/cost messages per second
however many partitions it owns: a stand-in for a downstream with one connection per
consumer), and the SDK publishing ``--rate`` msg/s over ``--keys`` keys drawn from a Zipf
distribution (exponent ``--zipf``; the same seeded sequence in every run). Lag of a
message = its first handling's start minus its publish time (``partq-published-ms``):
over the whole run, and over the window after ``--warmup`` seconds (the load-aware
coordinator needs a few load reports and ticks to move partitions).
Both modes alternate in one invocation (same load on the machine); at the end every
confirmed message must have been handled (lost 0) in per-key order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from bisect import bisect
from collections import Counter
from itertools import accumulate
from typing import Any

import mmh3
from partq.consumers.handling.message import Message
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer

from benchmarks.groups import AMQP, Bench, P, alternate, log, outcome
from examples import audit
from examples.handlers import record_handler

HANDLER = "benchmarks.lag:capacity_handler"
_CAPACITY = threading.Lock()  # one per consumer process: the member's fixed capacity


def capacity_handler(message: Message) -> None:
    """``$PARTQ_LAG_COST`` seconds of work per message, one message at a time per process
    (every partition of the member shares it), then one record line."""
    with _CAPACITY:
        time.sleep(float(os.environ.get("PARTQ_LAG_COST", "0.002")))
        record_handler(message)


class ZipfLoad(threading.Thread):
    """Publishes ``{"seq": n}`` (per-key sequence) at ``rate`` msg/s, keys Zipf-distributed."""

    def __init__(self, spec: StreamSpec, rate: float, keys: int, exponent: float) -> None:
        super().__init__(daemon=True)
        self.spec, self.rate = spec, rate
        self.keys = [f"k{i:04d}" for i in range(keys)]
        self.cumulative = list(accumulate(1 / (i + 1) ** exponent for i in range(keys)))
        self.halt = threading.Event()
        self.futures: list[tuple[str, int, Any]] = []

    def run(self) -> None:
        rng = random.Random(13)
        seqs: Counter[str] = Counter()
        total = self.cumulative[-1]
        with Producer(self.spec, amqp_url=AMQP, window=1000) as producer:
            n, t0 = 0, time.monotonic()
            while not self.halt.is_set():
                while n < int((time.monotonic() - t0) * self.rate):
                    key = self.keys[bisect(self.cumulative, rng.random() * total)]
                    seq = seqs[key]
                    seqs[key] += 1
                    body = json.dumps({"seq": seq})
                    self.futures.append((key, seq, producer.publish(key, body)))
                    n += 1
                time.sleep(0.005)
            producer.flush(120)

    def finish(self) -> set[tuple[str, int]]:
        self.halt.set()
        self.join(150)
        return {(k, s) for k, s, f in self.futures if f.done() and f.exception() is None}

    def shares(self) -> dict[int, float]:
        """Each partition's share of the published messages."""
        count = Counter(mmh3.hash(k, 0, signed=False) % P for k, _, _ in self.futures)
        return {p: count[p] / max(1, len(self.futures)) for p in range(P)}


def one(b: Bench, by_load: bool, args: argparse.Namespace) -> dict[str, Any]:
    spec = b.stream("lag", P, "quorum")
    record = b.dir / f"{spec.name}.jsonl"
    extra = ["--balance", "load", "--load-interval", "5", "--load-moves", "2"] if by_load else []
    procs = [b.coordinator(spec, AMQP, 1.0, *extra)]
    members = ["c1", "c2", "c3"]
    for m in members:
        procs.append(b.consumer(spec, m, record, handler=HANDLER, PARTQ_LAG_COST=str(args.cost)))
    assert b.settled(spec, members, 60), "the group never settled"
    load = ZipfLoad(spec, args.rate, args.keys, args.zipf)
    started = time.time()
    load.start()
    time.sleep(args.warmup + args.seconds)
    confirmed = load.finish()
    assignment = b.snapshot(spec).assignment
    deadline = time.monotonic() + 300
    while audit.lost(confirmed, audit.load(record)) and time.monotonic() < deadline:
        time.sleep(1)
    records = audit.load(record)
    b.stop(procs)
    b.drop(spec)
    first: dict[tuple[str, int], dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: r["start"]):
        first.setdefault((r["key"], r["seq"]), r)
    lags = sorted(r["start"] - r["published_ms"] / 1000 for r in first.values())
    window = started + args.warmup
    late = sorted(
        r["start"] - r["published_ms"] / 1000
        for r in first.values()
        if r["published_ms"] / 1000 >= window
    )
    coordinator_log = (b.dir / f"coord-{spec.name}.log").read_text(errors="replace")
    shares = load.shares()
    hot = max(sum(s for p, s in shares.items() if assignment.get(p) == m) for m in members)
    return {
        "p50": audit.percentile(lags, 50),
        "p99": audit.percentile(lags, 99),
        "max": lags[-1] if lags else float("nan"),
        "p99_late": audit.percentile(late, 99) if late else float("nan"),
        "hot_share": hot,
        "load_moves": sum(
            int(line.split("assignment load: ")[1].split()[0])
            for line in coordinator_log.splitlines()
            if "assignment load: " in line
        ),
        **outcome(records, confirmed),
        "published": len(confirmed),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=45.0, help="seconds before the window")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of the window")
    ap.add_argument("--cost", type=float, default=0.003, help="handler seconds per message")
    ap.add_argument("--keys", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.1)
    args = ap.parse_args(argv)
    before = os.getloadavg()

    def say(by_load: bool, r: dict[str, Any]) -> str:
        return (
            f"{'load' if by_load else 'count'}: lag p50 {r['p50'] * 1000:.0f} ms p99 {r['p99'] * 1000:.0f} ms "
            f"(window {r['p99_late'] * 1000:.0f} ms), hot member's share {r['hot_share']:.2f}, lost {r['lost']}, "
            f"order violations {r['violations']}"
        )

    results = alternate(args.rounds, lambda b, mode: one(b, mode, args), say)
    after = os.getloadavg()
    print(
        f"\nload average {before[0]:.2f} → {after[0]:.2f} (1 min); P = {P} quorum, 3 consumers of "
        f"capacity ≈ {1 / args.cost:.0f} msg/s each (handler {args.cost * 1000:.1f} ms under one lock), "
        f"{args.rate:.0f} msg/s offered over {args.keys} Zipf({args.zipf}) keys, {args.warmup:.0f} s of warm-up, then a {args.seconds:.0f} s window\n"
    )
    print(
        "| assignment | round | hot member's share of messages | load moves | lag p50 | lag p99 | p99 in the window | max | lost | order violations | duplicates |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for by_load in (False, True):
        name = "by load (`--balance load`)" if by_load else "by count (default)"
        for i, r in enumerate(results[by_load], 1):
            print(
                f"| {name} | {i} | {r['hot_share']:.2f} | {r['load_moves']} | {r['p50'] * 1000:.0f} ms | {r['p99'] * 1000:.0f} ms | "
                f"{r['p99_late'] * 1000:.0f} ms | {r['max'] * 1000:.0f} ms | {r['lost']} | {r['violations']} | {r['duplicates']} |"
            )
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
