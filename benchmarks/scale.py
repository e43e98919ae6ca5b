# ruff: noqa: E501  (report lines)
"""The coordinator at scale, against a real etcd and no broker (issue 12, item 5).

    .venv/bin/python -m benchmarks.scale [--partitions 10000] [--members 1000]

A private etcd; a stream spec of P partitions stored without queues (the coordinator
only reads depths for its page and metrics, which are not scraped here); M simulated
members joined on one shared lease (a member is its key; nothing consumes); one
``partq coordinator`` process (settle 1 s). Measured, each from a watch on the
stream's keys:

- the first assignment: seconds until all P assignment keys exist, their puts;
- a member joins, then the same member leaves: seconds from the change to the last
  assignment put of the rebalance, the puts (which must equal the partitions whose
  owner changed), and the coordinator's CPU seconds (utime + stime from /proc) for it;
- fan-out: every consumer watches its stream's prefix, so each put reaches every
  member: puts x members events per rebalance.

Prints a Markdown table with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Puts:
    """Counts puts of assignment keys seen by a watch, with the time of the last one."""

    def __init__(self, registry: Registry, stream: str) -> None:
        self.count = 0
        self.last = 0.0
        self.owners: dict[str, str] = {}
        self._lock = threading.Lock()
        prefix = keys.assignments(stream)

        def seen(response: Any) -> None:
            if isinstance(response, Exception) or response is None:
                return
            with self._lock:
                for event in response.events:
                    if type(event).__name__ == "PutEvent":
                        self.count += 1
                        self.last = time.monotonic()
                        self.owners[event.key.decode()] = event.value.decode()

        self.watch_id = registry.client.add_watch_prefix_callback(prefix, seen)

    def quiet(self, since: float, quiet: float = 2.0, timeout: float = 300.0) -> float:
        """Wait until no put came for ``quiet`` s; seconds from ``since`` to the last put."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                last = self.last
            if last > since and time.monotonic() - last >= quiet:
                return last - since
            time.sleep(0.1)
        raise RuntimeError("the coordinator never went quiet")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--partitions", type=int, default=10_000)
    ap.add_argument("--members", type=int, default=1_000)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    rows: list[tuple[str, float, int, int, float]] = []
    with LocalEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        registry = Registry.connect(Settings(etcd_endpoints=etcd.endpoint))  # type: ignore[call-arg]
        stream = f"scale-{uuid.uuid4().hex[:6]}"
        registry.create(StreamSpec(stream, args.partitions))
        group = Group(registry.client, registry.where, stream)
        session = Session(registry.client, registry.where, ttl=60)
        began = time.monotonic()
        for i in range(args.members):
            group.join(session, f"m{i:05d}")
        print(f"{args.members} members joined in {time.monotonic() - began:.1f}s", file=sys.stderr)
        puts = Puts(registry, stream)
        env = {**os.environ, "PARTQ_ETCD_ENDPOINTS": etcd.endpoint, "PYTHONPATH": str(REPO)}
        with open(Path(tmp) / "coordinator.log", "ab") as out:
            coordinator = subprocess.Popen(
                [sys.executable, "-m", "partq", "coordinator", stream, "--settle", "1", "--http-port", "0"],
                env=env, stdout=out, stderr=out, cwd=REPO,
            )  # fmt: skip
        try:
            t0, cpu0 = time.monotonic(), cpu_seconds(coordinator.pid)
            took = puts.quiet(t0)
            rows.append(
                (
                    "first assignment",
                    took,
                    puts.count,
                    args.partitions,
                    cpu_seconds(coordinator.pid) - cpu0,
                )
            )
            for what in ("join", "leave"):
                before = dict(puts.owners)
                count0, cpu0, t0 = puts.count, cpu_seconds(coordinator.pid), time.monotonic()
                if what == "join":
                    group.join(session, "newcomer")
                else:
                    group.leave("newcomer", session)
                took = puts.quiet(t0) - 1.0  # the settle time is not the coordinator's work
                changed = sum(1 for k, v in puts.owners.items() if before.get(k) != v)
                rows.append(
                    (
                        f"a member {what}s",
                        took,
                        puts.count - count0,
                        changed,
                        cpu_seconds(coordinator.pid) - cpu0,
                    )
                )
        finally:
            coordinator.terminate()
            coordinator.wait(30)
            registry.client.cancel_watch(puts.watch_id)
            session.close()
            registry.close()
    load_after = os.getloadavg()
    members = args.members
    print(
        f"\nP = {args.partitions}, {members} simulated members, real etcd, no broker; load average "
        f"{load_before[0]:.2f} → {load_after[0]:.2f} (1 min)\n"
    )
    print(
        "| event | seconds to the last put (settle excluded) | assignment puts | partitions changed | coordinator CPU s | fan-out (puts x members) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for what, took, n, changed, cpu in rows:
        print(f"| {what} | {took:.2f} | {n} | {changed} | {cpu:.2f} | {n * members} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
