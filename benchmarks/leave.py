# ruff: noqa: E501  (report lines)
"""Handoff gap of graceful leaves (SIGTERM), announced (the default) against not announced.

    .venv/bin/python -m benchmarks.leave [--rounds 3] [--rate 2000]

Per round and mode: a fresh P = 12 quorum stream, a coordinator (settle 1 s, as in
``benchmarks.groups``), consumers c1..c4 recording with the product's recorder, the SDK
publishing 100 keys at ``--rate``; once balanced, SIGTERM c4, c3, c2 one after the other,
each once the rest is balanced again. Gap = the leaving member's last handling of a
partition → the next owner's first (``examples.audit.handoff_gaps``), every move of
every leave. Both modes run in the same invocation, alternating, so the ratio is taken
under the same load. Prints a Markdown table (the machine's load with it).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from benchmarks.groups import Bench, Run, alternate
from examples import audit


def one(b: Bench, announce: bool, rate: float, dwell: float) -> dict[str, Any]:
    extra = {"PARTQ_ANNOUNCE_LEAVE": "true" if announce else "false"}
    run = Run(b, "leave", "quorum", ["c1", "c2", "c3", "c4"], rate, **extra)
    time.sleep(dwell)
    left = []
    for n in (4, 3, 2):
        proc = run.procs.pop(f"c{n}")
        t = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        done = b.settled(run.spec, [f"c{i}" for i in range(1, n)], 60)
        left.append(
            {
                "exit": code,
                "exited_after": time.time() - t,
                "settled_after": None if done is None else done - t,
            }
        )
        time.sleep(dwell)
    records, summary = run.finish()
    return summary | {"leaves": left, "gaps": audit.handoff_gaps(records)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--dwell", type=float, default=3.0)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()

    def say(announce: bool, res: dict[str, Any]) -> str:
        gaps = res["gaps"]
        return (
            f"{'announce' if announce else 'no-announce'}: {len(gaps)} moves, "
            f"gap p50 {audit.percentile(gaps, 50) * 1000:.0f} ms "
            f"p99 {audit.percentile(gaps, 99) * 1000:.0f} ms, order {res['order']}, "
            f"drained {res['drained']}, leaves {res['leaves']}"
        )

    results = alternate(args.rounds, lambda b, mode: one(b, mode, args.rate, args.dwell), say)
    load_after = os.getloadavg()
    print(
        f"\nload average {load_before[0]:.2f} → {load_after[0]:.2f} (1 min), rate {args.rate:.0f} msg/s, P = 12, rounds {args.rounds}\n"
    )
    print(
        "| SIGTERM leave | moves | gap p50 | gap p99 | max | lost | order violations | duplicates | overlaps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for announce in (True, False):
        gaps = [g for res in results[announce] for g in res["gaps"]]
        lost = sum(res["order"].get("lost", 0) for res in results[announce])
        order = sum(res["order"].get("violations", 0) for res in results[announce])
        dups = sum(res["order"].get("duplicates", 0) for res in results[announce])
        overlaps = sum(res["order"].get("overlaps", 0) for res in results[announce])
        print(
            f"| {'announced (default)' if announce else '--no-announce-leave'} | {len(gaps)} | "
            f"{audit.percentile(gaps, 50) * 1000:.0f} ms | {audit.percentile(gaps, 99) * 1000:.0f} ms | "
            f"{max(gaps, default=float('nan')) * 1000:.0f} ms | {lost} | {order} | {dups} | {overlaps} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
