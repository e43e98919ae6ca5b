# ruff: noqa: E501  (report lines)
"""Crash failover with and without hot standby (``coordinator --standby``), same run.

    .venv/bin/python -m benchmarks.failover [--rounds 3] [--rate 2000] [--ttl 5] [--freeze]

Each round and mode: ``benchmarks.groups.failover``: a fresh P = 12 quorum stream, a
coordinator, consumers c1 and c2 (lease TTL ``--ttl``) recording with the product's
recorder, the SDK publishing 100 keys at ``--rate``; once balanced, ``kill -9`` c2; failover
of a partition = the kill → c1's first handling of it. Modes alternate in one invocation.
Prints a Markdown table with the machine's load.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks.groups import Bench, alternate, failover
from examples import audit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--ttl", type=int, default=5)
    ap.add_argument("--dwell", type=float, default=3.0)
    ap.add_argument(
        "--freeze",
        action="store_true",
        help="SIGSTOP the member instead of kill -9: bounded by the AMQP heartbeat",
    )
    args = ap.parse_args(argv)
    load_before = os.getloadavg()

    def say(standby: bool, res: dict[str, Any]) -> str:
        times = sorted(res["failover"].values())
        return (
            f"{'standby' if standby else 'lease'}: {len(times)} partitions, "
            f"failover {[round(t * 1000) for t in times]} ms, order {res['order']}"
        )

    def run(b: Bench, standby: bool) -> dict[str, Any]:
        return failover(
            b, "quorum", args.ttl, args.rate, args.dwell, standby=standby, freeze=args.freeze
        )

    results = alternate(args.rounds, run, say)
    load_after = os.getloadavg()
    print(
        f"\nload average {load_before[0]:.2f} → {load_after[0]:.2f} (1 min), {args.rate:.0f} msg/s, P = 12, TTL {args.ttl} s, rounds {args.rounds}\n"
    )
    print(
        f"| after {'SIGSTOP' if args.freeze else 'kill -9'} of one of 2 consumers | partitions | failover p50 | p99 | max | lost | order violations | overlaps | redelivered |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for standby in (True, False):
        times = [t for res in results[standby] for t in res["failover"].values()]
        total = {
            k: sum(res["order"].get(k, 0) for res in results[standby])
            for k in ("lost", "violations", "overlaps", "redelivered")
        }
        print(
            f"| {'hot standby (--standby)' if standby else 'lease expiry (--no-standby)'} | {len(times)} | "
            f"{audit.percentile(times, 50) * 1000:.0f} ms | {audit.percentile(times, 99) * 1000:.0f} ms | "
            f"{max(times, default=float('nan')) * 1000:.0f} ms | {total['lost']} | {total['violations']} | {total['overlaps']} | {total['redelivered']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
