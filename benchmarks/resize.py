# ruff: noqa: E501  (report lines)
"""An online resize under load (issue 22): 12 -> 24, then 24 -> 16, with ``partq stream resize``.

    .venv/bin/python -m benchmarks.resize [--url amqp://guest:guest@127.0.0.1:5672/%2F]
        [--rate 2000] [--keys 200] [--steady 10] [--producer sdk|spark] [--standby]
        [--logs DIR]

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

``--producer spark``: the load is ``partq spark-job --rate RATE`` instead (its own process
session, a micro-batch every 0.5 s at most, Spark ``local[2]``), started ``--steady``
seconds before the baseline so that its JVM is warm; its rows are the values 0, 1, 2, ...
under key ``key-<value % 1000>``, and the consumers record each value as its key's seq.
"Confirmed" are the values of every batch the job logged as published before SIGTERM
stopped it; the rate printed is those published from the baseline's start to the stop,
per second. A batch's rows arrive as one burst, so a key's largest latency in a window is
well above the median without any resize: the same measure over a window of the baseline
as long as the grow's is printed beside it, and each window's message latencies. ``--standby``: the coordinator names a hot
standby consumer per partition (``partq coordinator --standby``); printed: how many
partitions had one named in etcd before each resize and at the end, and how many a
consumer stood by for.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.registry import Registry
from partq.producer.spark.job import RATE_KEYS

from examples import audit
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.cluster import kill_session
from tests.integration.groups.harness import PARTQ, ROOT, Fleet, balanced, wait_until
from tests.integration.groups.test_resize_clients import KeyedLoad
from tests.spark.conftest import SPARK_CONF_ARGS

MEMBERS = {"c1", "c2", "c3"}
STANDING_BY = re.compile(r"partition (\d+): standing by behind")


class SparkLoad:
    """``partq spark-job --rate`` publishing to the fleet's stream from its own process
    session; Spark's JVM (and its Python workers) run in a session of their own, which
    ``close`` ends too."""

    BATCH = re.compile(r"batch (\d+): (\d+) rows published")
    # A task's warning (its Python worker logs warnings only, so a batch's count of
    # republished messages does not reach the log).
    HELD = "holding publishes until etcd has a newer layout"

    def __init__(self, fleet: Fleet, rate: float, tmp: Path) -> None:
        self.log = tmp / "spark-job.log"
        argv = [str(PARTQ), "spark-job", "--stream", fleet.stream, "--rate", str(round(rate))]
        argv += ["--checkpoint", str(tmp / "checkpoint"), "--trigger-seconds", "0.5"]
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                [*argv, *SPARK_CONF_ARGS],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=fleet._env(),
                cwd=ROOT,
                start_new_session=True,
            )
        self.sessions = {self.popen.pid}

    def batches(self) -> dict[int, int]:
        """Rows of each batch the job logged as published (committed)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return {int(b): int(rows) for b, rows in self.BATCH.findall(text)}

    def held(self) -> int:
        """Tasks whose publishes a resize's cut returned, so they waited for its switch."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(self.HELD)

    def wait_publishing(self, timeout: float) -> None:
        """Until a batch with rows is published; notes the sessions the job started."""

        def publishing() -> bool:
            if self.popen.poll() is not None:
                raise SystemExit(f"partq spark-job exited {self.popen.returncode}: {self.log}")
            return any(self.batches().values())

        wait_until(publishing, timeout, 0.2, "the Spark job's first rows")
        for child in _children(self.popen.pid):
            with contextlib.suppress(OSError):
                self.sessions.add(int(_stat(child)[3]))

    def stop(self) -> int | None:
        """SIGTERM to the job's process group: it stops the query between batches."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            return self.popen.wait(120)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        for session in sorted(self.sessions):
            kill_session(session)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def published(self) -> set[tuple[str, int]]:
        """(key, value) of every row of the published batches: the source's values run
        from 0 without a gap, batch after batch."""
        rows = sum(self.batches().values())
        return {(f"key-{value % RATE_KEYS}", value) for value in range(rows)}


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int(_stat(int(entry.name))[1]) == parent:
                    found.append(int(entry.name))
    return found


def standbys_named(group: Group, registry: Registry) -> str:
    """How many of the current partitions have a hot standby named in etcd."""
    spec = registry.read_spec(group.stream)
    named = sum(1 for p in group.snapshot().standbys if p < spec.partitions)
    return f"{named} of {spec.partitions}"


def standing_by(fleet: Fleet) -> int:
    """Partitions a consumer subscribed to as hot standby at some time (their logs):
    RabbitMQ's consumer count leaves a single active consumer's waiting ones out."""
    logs = (proc.log.read_text(errors="replace") for proc in fleet.procs if proc.log.exists())
    return len({p for text in logs for p in STANDING_BY.findall(text)})


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
    return float(record["start"]) - float(record["published_ms"]) / 1000.0


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


def latencies(records: list[dict[str, Any]], window: tuple[float, float]) -> str:
    ms = [
        latency(r) * 1000 for r in records if window[0] <= r["published_ms"] / 1000.0 <= window[1]
    ]
    if not ms:
        return "no messages"
    return f"{len(ms)}: p50 {percentile(ms, 0.5):.0f} ms, p99 {percentile(ms, 0.99):.0f} ms, max {max(ms):.0f} ms"


def published_rate(
    sent: set[tuple[str, int]], records: list[dict[str, Any]], window: tuple[float, float]
) -> float:
    """Messages of ``sent`` published in ``window``, per second (from the handlers' records)."""
    stamps = {(r["key"], r["seq"]): r["published_ms"] / 1000.0 for r in records}
    inside = sum(1 for m in sent if window[0] <= stamps.get(m, 0.0) <= window[1])
    return inside / (window[1] - window[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--keys", type=int, default=200, help="SDK producer's keys")
    parser.add_argument("--steady", type=float, default=10.0)
    parser.add_argument("--producer", choices=["sdk", "spark"], default="sdk")
    parser.add_argument(
        "--standby", action="store_true", help="coordinator --standby (else --no-standby)"
    )
    parser.add_argument("--logs", type=Path, help="copy the processes' logs here at the end")
    args = parser.parse_args()
    name = f"bench-resize-{uuid.uuid4().hex[:8]}"
    spark = args.producer == "spark"
    with LocalEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint))
        spec12 = StreamSpec(name, 12, "quorum")
        admin.create_stream(registry, args.url, spec12)
        fleet = Fleet(name, Path(tmp), etcd.endpoint, args.url, Path(tmp) / "rec.jsonl")
        group = Group(registry.client, registry.where, name)
        handler = "record_rate" if spark else "record"
        load: KeyedLoad | None = None
        job: SparkLoad | None = None
        producer: Producer | None = None
        try:
            fleet.coordinator(extra=("--standby",) if args.standby else ("--no-standby",))
            fleet.consumer("c1", handler=handler)
            fleet.consumer("c2", handler=handler, extra=("--concurrency", "8"))
            fleet.consumer("c3", handler=handler)
            wait_until(lambda: balanced(group, 12, MEMBERS), 60, 0.1, "12 balanced")
            if args.standby:
                wait_until(lambda: len(group.snapshot().standbys) == 12, 60, 0.1, "12 standbys")
            standbys: list[str] = []
            if spark:
                job = SparkLoad(fleet, args.rate, Path(tmp))
                job.wait_publishing(300)
                time.sleep(args.steady)  # Spark warms up: the baseline starts after this
            else:
                producer = Producer(name, amqp_url=args.url, etcd=registry, name="bench-resize")
                load = KeyedLoad(producer, keys=args.keys, rate=args.rate)
                load.start()
            steady_from = time.time()
            time.sleep(args.steady)
            if args.standby:
                standbys.append(f"before 12 -> 24 {standbys_named(group, registry)}")
            grow = resize_to(fleet, registry, 24)
            spec24 = registry.read_spec(name)
            time.sleep(args.steady)
            if args.standby:
                standbys.append(f"before 24 -> 16 {standbys_named(group, registry)}")
            shrink = resize_to(fleet, registry, 16)
            spec16 = registry.read_spec(name)
            time.sleep(args.steady)
            steady_to = time.time()
            if args.standby:
                standbys.append(f"at the end {standbys_named(group, registry)}")
            if job is not None:
                job_exit = job.stop()
                sent = job.published()
                failed = f"the job's exit code on SIGTERM {job_exit}"
                rerouted = f"tasks held for a newer layout {job.held()}"
            else:
                assert load is not None and producer is not None
                load.stop()
                producer.close()
                sent = load.published()
                failed = f"failed publishes {len(load.failed)}"
                rerouted = f"returned and republished {producer.rerouted}"
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
            with_standbys = ", hot standbys" if args.standby else ""
            if spark:
                offered = (
                    f"partq spark-job --rate {args.rate:.0f} "
                    f"({published_rate(sent, records, (steady_from, steady_to)):.0f} msg/s "
                    f"published from the baseline's start to the load's stop) over {RATE_KEYS} keys"
                )
            else:
                offered = f"{args.rate:.0f} msg/s over {args.keys} keys"
            print(
                f"load average {load_avg}; {offered}, 3 consumers (one --concurrency 8){with_standbys}, quorum, RabbitMQ at {args.url.rsplit('@', 1)[-1]}"
            )
            print(
                f"{len(sent)} confirmed, {len(records)} handled: lost {len(audit.lost(sent, records))}, "
                f"order violations {len(audit.order_violations(records))}, same-key overlaps {len(audit.key_overlaps(records))}, "
                f"{failed}, {rerouted}; "
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
            if spark:  # bursts of a batch's rows: what the same measures give with no resize
                window = (steady_from + 1, min(steady_from + 2 + grow[3], grow[0] - 1))
                calm = extra_waits(records, window, baseline, spec12, spec12)["stayed"]
                print(
                    f"no resize (a {window[1] - window[0]:.2f} s window of the baseline; "
                    f"12 -> 24's was {grow[3] + 1:.2f} s): extra wait per key: {shown(calm)}"
                )
                print(
                    "latency of each message (handler start - publish) published in the window: "
                    f"no resize {latencies(records, window)}; "
                    f"12 -> 24 {latencies(records, (grow[0] - 1.0, grow[1]))}; "
                    f"24 -> 16 {latencies(records, (shrink[0] - 1.0, shrink[1]))}"
                )
            if standbys:
                print(
                    f"standbys named in etcd: {'; '.join(standbys)}; partitions stood by "
                    f"(consumers' logs): {standing_by(fleet)} of 24"
                )
        finally:
            if load is not None:
                load.stop()
            if job is not None:
                job.stop()
                job.close()
            fleet.close()
            subprocess.run(
                [str(PARTQ), "stream", "delete", name, "--yes"],
                env=fleet._env(),
                capture_output=True,
                timeout=120,
                check=False,
            )
            registry.close()
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in [*Path(tmp).glob("*.log"), fleet.record]:
                    if log.exists():
                        shutil.copy(log, args.logs / log.name)


if __name__ == "__main__":
    main()
