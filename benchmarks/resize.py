# ruff: noqa: E501  (report lines)
"""An online resize under load (issue 22): 12 -> 24, then 24 -> 16, with ``partq stream resize``.

    .venv/bin/python -m benchmarks.resize [--url amqp://guest:guest@127.0.0.1:5672/%2F]
        [--rate 2000] [--keys 200] [--steady 10]

On a fresh quorum stream of 12 partitions (a private etcd, the given RabbitMQ): a
coordinator and three consumer daemons (``partq consume``, the recording handler of the
integration tests, one with ``--concurrency 8``), and an SDK ``Producer`` that follows the
spec publishing ``--keys`` keys' sequences at ``--rate`` msg/s throughout. After
``--steady`` seconds it runs ``partq stream resize NAME --partitions 24 --wait``, then
``--steady`` seconds later ``--partitions 16 --wait``, then ``--steady`` seconds more, and
stops the load. Reported: messages lost (confirmed, never handled), per-key order
violations and same-key overlaps over the whole run; per resize the time from the
command's start to the switch (the spec's epoch seen changed in etcd, polled every 10 ms)
and to its exit (``--wait``: every old partition's fence handled, a shrink's queues
deleted); and the per-key extra wait: for each key, the largest handling latency (handler
start minus the publish time) of its messages published from 1 s before the command to
its exit, minus the median latency of the ``--steady`` seconds before the first resize;
split into keys whose partition the resize moved and keys it did not. Report the
machine's load beside it (printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from consumers import audit
from coordinator import admin
from coordinator.group import Group
from kernel.local import LocalEtcd
from kernel.settings import Settings
from producer import Producer, StreamSpec
from producer.registry import Registry
from tests.integration.groups.harness import PARTQ, Fleet, balanced, wait_until
from tests.integration.groups.test_resize_clients import KeyedLoad

MEMBERS = {"c1", "c2", "c3"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def resize_to(
    fleet: Fleet, registry: Registry, partitions: int
) -> tuple[float, float, float, float]:
    """Run the command; (wall start, wall end, seconds to the switch, seconds to exit)."""
    epoch = registry.read_spec(fleet.stream).epoch
    argv = [str(PARTQ), "stream", "resize", fleet.stream, "--partitions", str(partitions)]
    began_wall, began = time.time(), time.monotonic()
    command = fleet.process(f"resize-{partitions}", [*argv, "--wait", "--timeout", "300"])
    switched = None
    deadline = began + 320
    while command.alive() and time.monotonic() < deadline:
        if switched is None and registry.read_spec(fleet.stream).epoch > epoch:
            switched = time.monotonic() - began
        time.sleep(0.01)
    code = command.popen.wait(30)
    done = time.monotonic() - began
    if code != 0:
        raise SystemExit(
            f"partq stream resize --partitions {partitions} exited {code}:\n{command.tail()}"
        )
    return began_wall, time.time(), switched if switched is not None else done, done


def latency(record: dict[str, Any]) -> float:
    return float(record["start"]) - record["published_ms"] / 1000.0


def extra_waits(
    records: list[dict[str, Any]],
    window: tuple[float, float],
    baseline: float,
    old: StreamSpec,
    new: StreamSpec,
) -> dict[str, list[float]]:
    """Per key, its largest latency in ``window`` minus ``baseline``: moved and stayed keys."""
    worst: dict[str, float] = {}
    for r in records:
        if window[0] <= r["published_ms"] / 1000.0 <= window[1]:
            worst[r["key"]] = max(worst.get(r["key"], 0.0), latency(r) - baseline)
    split: dict[str, list[float]] = {"moved": [], "stayed": []}
    for key, wait in worst.items():
        moved = old.partition_for(key) != new.partition_for(key)
        split["moved" if moved else "stayed"].append(wait)
    return split


def shown(waits: list[float]) -> str:
    if not waits:
        return "no keys"
    ms = [w * 1000 for w in waits]
    return f"{len(ms)} keys: p50 {percentile(ms, 0.5):.0f} ms, p99 {percentile(ms, 0.99):.0f} ms, max {max(ms):.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--steady", type=float, default=10.0)
    args = parser.parse_args()
    name = f"bench-resize-{uuid.uuid4().hex[:8]}"
    with LocalEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint))
        spec12 = StreamSpec(name, 12, "quorum")
        admin.create_stream(registry, args.url, spec12)
        fleet = Fleet(name, Path(tmp), etcd.endpoint, args.url, Path(tmp) / "rec.jsonl")
        group = Group(registry.client, registry.where, name)
        load: KeyedLoad | None = None
        try:
            fleet.coordinator()
            fleet.consumer("c1")
            fleet.consumer("c2", extra=("--concurrency", "8"))
            fleet.consumer("c3")
            wait_until(lambda: balanced(group, 12, MEMBERS), 60, 0.1, "12 balanced")
            producer = Producer(name, amqp_url=args.url, etcd=registry, name="bench-resize")
            load = KeyedLoad(producer, keys=args.keys, rate=args.rate)
            load.start()
            steady_from = time.time()
            time.sleep(args.steady)
            grow = resize_to(fleet, registry, 24)
            spec24 = registry.read_spec(name)
            time.sleep(args.steady)
            shrink = resize_to(fleet, registry, 16)
            spec16 = registry.read_spec(name)
            time.sleep(args.steady)
            load.stop()
            producer.close()
            sent = load.published()
            wait_until(
                lambda: not audit.lost(sent, fleet.records()), 120, 0.5, "everything handled"
            )
            records = fleet.records()
            baseline = statistics.median(
                latency(r)
                for r in records
                if steady_from + 1 <= r["published_ms"] / 1000.0 <= grow[0]
            )
            load_avg = " ".join(f"{v:.1f}" for v in os.getloadavg())
            print(
                f"load average {load_avg}; {args.rate:.0f} msg/s over {args.keys} keys, 3 consumers (one --concurrency 8), quorum, RabbitMQ at {args.url.rsplit('@', 1)[-1]}"
            )
            print(
                f"{len(sent)} confirmed, {len(records)} handled: lost {len(audit.lost(sent, records))}, "
                f"order violations {len(audit.order_violations(records))}, same-key overlaps {len(audit.key_overlaps(records))}, "
                f"failed publishes {len(load.failed)}, returned and republished {producer.rerouted}; "
                f"baseline latency (median) {baseline * 1000:.0f} ms"
            )
            for label, (start, end, switched, done), old, new in (
                ("12 -> 24", grow, spec12, spec24),
                ("24 -> 16", shrink, spec24, spec16),
            ):
                split = extra_waits(records, (start - 1.0, end), baseline, old, new)
                print(
                    f"{label}: switch {switched:.2f} s, exit (retired) {done:.2f} s; extra wait per key, "
                    f"moved: {shown(split['moved'])}; stayed: {shown(split['stayed'])}"
                )
        finally:
            if load is not None:
                load.stop()
            fleet.close()
            subprocess.run(
                [str(PARTQ), "stream", "delete", name, "--yes"],
                env=fleet._env(),
                capture_output=True,
                timeout=120,
                check=False,
            )
            registry.close()


if __name__ == "__main__":
    main()
