# ruff: noqa: E501  (report lines)
"""The other keys' throughput while one key is parked, against no parked key (issue 13).

    .venv/bin/python -m benchmarks.parking [--rounds 3] [--rate 4000] [--dwell 12]

Per round and mode: a fresh P = 12 quorum stream with ``on_failure = park``, a
coordinator, consumers c1 and c2 running ``tests.integration.groups.recorder:poison_key``
(no handler work), the SDK publishing 100 keys at ``--rate`` (above what two consumers
handle on this machine, so the consumers set the pace). In the *poisoned* mode every
message of key k005 fails (``--max-attempts 2``): the key is parked at its first message
and every later one goes to its parking queue. Throughput of the other 99 keys = their
handlings per second over the window from 3 s after the first handling to the end of
the dwell. Both modes run alternately in one invocation (same load on the machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.groups import Bench, Run, alternate
from examples import audit

POISON_KEY = "k005"
HANDLER = "tests.integration.groups.recorder:poison_key"


def one(b: Bench, poisoned: bool, rate: float, dwell: float, flag: Path) -> dict[str, Any]:
    run = Run(
        b, "park", "quorum", ["c1", "c2"], rate, on_failure="park", handler=HANDLER,
        PARTQ_POISON_KEY=POISON_KEY if poisoned else "nobody", PARTQ_POISON_SEQ="0",
        PARTQ_POISON_FLAG=str(flag),
    )  # fmt: skip
    time.sleep(dwell)
    parked = len(b.snapshot(run.spec).parked)
    records = audit.load(run.record)
    run.load.halt.set()  # stop publishing; what was published is left in the queues
    run.load.join(150)
    b.stop(run.procs.values())
    b.drop(run.spec, run.amqp)
    t0 = min(r["start"] for r in records) + 3.0
    t1 = max(r["start"] for r in records)
    others = [r for r in records if r["key"] != POISON_KEY and t0 <= r["start"] <= t1]
    return {
        "rate": len(others) / (t1 - t0),
        "parked_keys": parked,
        "poison_handled": sum(1 for r in records if r["key"] == POISON_KEY),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=4000.0)
    ap.add_argument("--dwell", type=float, default=12.0)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        flag = Path(tmp) / "poisoned"
        flag.touch()

        def say(poisoned: bool, res: dict[str, Any]) -> str:
            return f"{'poisoned' if poisoned else 'baseline'}: other keys {res['rate']:.0f}/s, parked keys {res['parked_keys']}"

        results = alternate(
            args.rounds, lambda b, mode: one(b, mode, args.rate, args.dwell, flag), say
        )
    load_after = os.getloadavg()
    poisoned = [r["rate"] for r in results[True]]
    baseline = [r["rate"] for r in results[False]]
    print(
        f"\nload average {load_before[0]:.2f} → {load_after[0]:.2f} (1 min), offered {args.rate:.0f} msg/s, P = 12, 2 consumers, rounds {args.rounds}\n"
    )
    print("| mode | other keys handled/s (per round) | mean | parked keys |")
    print("|---|---|---:|---:|")
    for mode, rates in (("one key parked", poisoned), ("no key parked", baseline)):
        parked = [r["parked_keys"] for r in results[mode == "one key parked"]]
        print(
            f"| {mode} | {', '.join(f'{r:.0f}' for r in rates)} | {sum(rates) / len(rates):.0f} | {parked} |"
        )
    ratio = (sum(poisoned) / len(poisoned)) / (sum(baseline) / len(baseline))
    print(f"\nratio (other keys, one parked / none parked): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
