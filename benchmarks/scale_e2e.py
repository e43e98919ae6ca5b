# ruff: noqa: E501  (report lines)
"""P = 1,000 partitions and 50 consumers end to end on this machine (issue 12, item 5).

    .venv/bin/python -m benchmarks.scale_e2e [--partitions 1000] [--consumers 50] [--queue-type classic]

A private etcd, the machine's RabbitMQ; a fresh stream of P queues; one coordinator
(settle 1 s); N ``partq consume`` processes (record handler, no work), started one after
another; a light SDK load (100 msg/s over 100 keys) throughout. Measured: seconds until
the group is settled (every member registered, balanced, every claim held) after the
N-th start, after one more member joins, and after a ``kill -9`` of one member (lease
TTL 5 s); the broker's memory (``rabbitmqctl status``) before the stream, with it and
the group, and after; lost and order violations at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from typing import Any

from benchmarks.groups import Bench, Load, outcome
from examples import audit
from partq.kernel.local import LocalEtcd


def broker_memory_mib() -> float:
    out = subprocess.run(
        ["rabbitmqctl", "status", "--formatter", "json"], capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    total = json.loads(out).get("memory", {}).get("total", {})
    value = total.get("rss") or total.get("erlang") or 0
    return float(value) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--partitions", type=int, default=1000)
    ap.add_argument("--consumers", type=int, default=50)
    ap.add_argument("--queue-type", default="classic")
    args = ap.parse_args(argv)
    import tempfile
    from pathlib import Path

    load_before = os.getloadavg()
    rows: list[tuple[str, Any]] = []
    memory = {"before": broker_memory_mib()}
    with LocalEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        b = Bench(etcd, Path(tmp))
        spec = b.stream("scale", args.partitions, args.queue_type)
        record = b.dir / "records.jsonl"
        try:
            b.coordinator(spec)
            members = [f"c{i:02d}" for i in range(args.consumers)]
            began = time.time()
            procs = {m: b.consumer(spec, m, record) for m in members}
            load = Load(spec, 100.0)
            load.start()
            done = b.settled(spec, members, 600)
            rows.append(
                (
                    f"{args.consumers} consumers started, settled",
                    None if done is None else done - began,
                )
            )
            memory["with the group"] = broker_memory_mib()
            t = time.time()
            procs["extra"] = b.consumer(spec, "extra", record)
            done = b.settled(spec, [*members, "extra"], 300)
            rows.append(("one more joins, settled", None if done is None else done - t))
            victim = members[0]
            t = time.time()
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(10)
            done = b.settled(spec, [*members[1:], "extra"], 300)
            rows.append(("kill -9 of one (TTL 5 s), settled", None if done is None else done - t))
            confirmed = load.finish()
            deadline = time.monotonic() + 120
            while audit.lost(confirmed, audit.load(record)) and time.monotonic() < deadline:
                time.sleep(0.5)
            rows.append(("order (lost, violations, …)", outcome(audit.load(record), confirmed)))
        finally:
            b.stop(b.procs)
            b.drop(spec)
            b.registry.close()
    memory["after"] = broker_memory_mib()
    load_after = os.getloadavg()
    print(
        f"\nP = {args.partitions} {args.queue_type} queues, {args.consumers} consumers, 100 msg/s; "
        f"load average {load_before[0]:.2f} → {load_after[0]:.2f} (1 min)\n"
    )
    print("| event | result |")
    print("|---|---|")
    for what, value in rows:
        shown = f"{value:.1f} s" if isinstance(value, float) else str(value)
        print(f"| {what} | {shown} |")
    print("| broker memory (MiB) | " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
