# ruff: noqa: E501, RUF001  (Markdown tables and the units in them)
"""Spark sink throughput (issue 4): rows/s from Spark into RabbitMQ, against raw pika.

    .venv/bin/python -m benchmarks.spark_sink [--rows 100000] [--repeats 3] [--no-write]

Uses a private etcd (LocalEtcd), the machine's RabbitMQ (PARTQ_AMQP_URL) and a
local Spark (``local[N]``, N = --cores). Each measurement publishes into a
fresh P = 8 quorum stream and checks that every row reached the queues:

* ``partq sink`` — ``prepare()`` + ``writeStream.format("partq")`` on a JSON
  file source (one micro-batch of all rows, ``trigger(availableNow=True)``);
* ``foreach_batch_writer`` — the same source through ``foreachBatch``;
* ``naive foreachBatch`` — ``prepare()``, then each task publishes with a pika
  ``BlockingConnection`` and waits for every confirm (``--naive-rows`` rows
  only, as it is slow; its rate is reported as measured);
* ``raw pika pipelined`` — ``benchmarks.publish.publish_pipelined``: one
  process, ``SelectConnection``, confirms in a callback, window 1000;
* ``task`` — ``partq.producer.spark.publish.publish_task`` (what each Spark task runs)
  fed the same rows in this process, without Spark: the per-task publisher
  against the raw loop, with CPU seconds per 10k messages for both.

For every Spark run the table also gives where the machine's CPU went meanwhile,
read from ``/proc``: the broker (``beam.smp``), Spark's JVM, its Python workers,
this driver, and everything else (other users' work), with the machine's busy
share of all cores: what bounds ``local[N]`` when the cores are all busy.

Spark rates are rows / the micro-batch's duration as Spark reports it (read,
partition UDF, shuffle, publish, all confirms, commit). A warm-up query runs
first. Runs are interleaved and the table shows medians. Writes the section
"## Spark sink throughput (issue 4)" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pika
import pyspark
from partq.coordinator.ops import admin
from partq.producer.contract import StreamSpec, partition_for
from partq.producer.properties import message_properties
from partq.producer.registry import Registry
from partq.producer.spark import (
    PARTITION_COLUMN,
    SinkOptions,
    foreach_batch_writer,
    loopback_session,
    prepare,
)
from partq.producer.spark.publish import publish_task
from partq.producer.spark.rows import POSITION_COLUMN, RowLayout
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from benchmarks.cpu import busy_share, jiffies
from benchmarks.publish import Workload, cpu_model, publish_pipelined, queue_depth, rabbitmq_version
from partq.kernel.amqp import DEFAULT_AMQP_URL, blocking_connection
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Spark sink throughput (issue 4)"
NOTES = "### Notes (hand-written; kept when the script re-runs)"
SCHEMA = "key STRING, payload STRING"
METHODS = ("sink", "foreach", "naive", "raw", "task")
GROUPS = ("broker", "spark-jvm", "python-workers", "driver", "other")
LABELS = {
    "task": "partq `publish_task` (1 process, no Spark)",
    "sink": 'partq sink (`format("partq")`)',
    "foreach": "partq `foreach_batch_writer`",
    "naive": "naive foreachBatch, wait for each confirm",
    "raw": "raw pika pipelined (1 process, window 1000)",
}


@dataclass(frozen=True)
class Run:
    method: str
    cores: int  # Spark's local[N] during this run (raw runs too: they are interleaved)
    rows: int
    seconds: float  # the micro-batch's duration (Spark) or first publish → last confirm (raw)
    wall: float  # start() → the query ended (Spark) or = seconds (raw)
    cpu: float = float("nan")  # this process's CPU seconds (raw, task)
    # CPU seconds by process group over a Spark run, and the machine's busy share
    breakdown: tuple[tuple[str, float], ...] = ()
    busy: float = float("nan")

    @property
    def rate(self) -> float:
        return self.rows / self.seconds


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_rows(directory: Path, rows: int, keys: int, size: int, files: int = 8) -> None:
    directory.mkdir(parents=True)
    payload = "x" * size
    per_file = -(-rows // files)
    for n in range(files):
        lines = (
            json.dumps({"key": f"key-{i % keys}", "payload": payload})
            for i in range(n * per_file, min(rows, (n + 1) * per_file))
        )
        (directory / f"part-{n:03d}.json").write_text("\n".join(lines) + "\n")


# -- where the CPU goes: /proc --------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _group(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
    except OSError:
        return "other"
    if pid == os.getpid():
        return "driver"
    if comm == "beam.smp":
        return "broker"
    if comm == "java" and b"spark" in cmdline.lower():
        return "spark-jvm"
    if b"pyspark" in cmdline:
        return "python-workers"
    return "other"


def cpu_snapshot() -> tuple[dict[int, tuple[str, float]], float, float]:
    """Every process's (group, CPU seconds), and the machine's busy and total jiffies."""
    procs: dict[int, tuple[str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(name)] = (_group(int(name)), (int(fields[11]) + int(fields[12])) / _TICK)
    return procs, *jiffies()


def cpu_breakdown(
    before: tuple[dict[int, tuple[str, float]], float, float],
    after: tuple[dict[int, tuple[str, float]], float, float],
) -> tuple[tuple[tuple[str, float], ...], float]:
    """CPU seconds by group between two snapshots (a process born since counts from 0),
    and the share of all cores that was busy."""
    totals = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, seconds) in after[0].items():
        totals[group] += seconds - before[0].get(pid, (group, 0.0))[1]
    return tuple(totals.items()), busy_share(before[1:], after[1:])


# -- the per-task publisher without Spark -------------------------------------------------------


def publish_rows_task(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """``publish_task`` on ``n`` rows shaped as ``prepare()`` leaves them (key, payload,
    partition, position), in this process: (wall seconds, CPU seconds)."""
    schema = StructType(
        [
            StructField("key", StringType()),
            StructField("payload", StringType()),
            StructField(PARTITION_COLUMN, IntegerType()),
            StructField(POSITION_COLUMN, LongType()),
        ]
    )
    options = SinkOptions(
        spec.name, "key", value_column="payload", amqp_url=url, window=work.window
    )
    layout = RowLayout.from_schema(schema, options, spec)
    payload = work.body.decode()
    rows = [
        (work.key(i), payload, partition_for(work.key(i), spec.partitions), i) for i in range(n)
    ]
    cpu0, t0 = time.process_time(), time.perf_counter()
    report = publish_task(
        rows, layout=layout, spec=spec, options=options, query_id="bench", batch_id=0, task=0
    )
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if report.rows != n:
        raise SystemExit(f"task: {report.rows} of {n} rows reported")
    return elapsed, cpu


# -- the naive sink: module level so that Spark pickles it by value from __main__ ----------


def _naive_task(rows: Iterable[Any], *, url: str, exchange: str) -> Iterator[int]:
    sent = 0
    with blocking_connection(url, name="bench-naive") as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        for row in rows:
            partition = row[PARTITION_COLUMN]
            channel.basic_publish(  # returns only when the broker confirmed it
                exchange,
                str(partition),
                row["payload"].encode(),
                message_properties(row["key"], partition),
                mandatory=True,
            )
            sent += 1
    yield sent


def naive_writer(spec: StreamSpec, url: str) -> Callable[[DataFrame, int], None]:
    def write(df: DataFrame, batch_id: int) -> None:
        task = functools.partial(_naive_task, url=url, exchange=spec.exchange)
        prepare(df, spec, "key").rdd.mapPartitions(task).collect()

    return write


# -- measuring ---------------------------------------------------------------------------------


def run_query(
    spark: SparkSession, method: str, spec: StreamSpec, source: Path, url: str, etcd: str
) -> Run:
    frame = spark.readStream.schema(SCHEMA).json(str(source))
    checkpoint = tempfile.mkdtemp(prefix="partq-bench-chk-")
    if method == "sink":
        options = SinkOptions(
            spec.name, "key", value_column="payload", amqp_url=url, etcd_endpoints=etcd
        ).pinned()
        writer = (
            prepare(frame, spec, "key").writeStream.format("partq").options(**options.to_options())
        )
    elif method == "foreach":
        writer = frame.writeStream.foreachBatch(
            foreach_batch_writer(
                spec.name,
                key_column="key",
                value_column="payload",
                amqp_url=url,
                etcd_endpoints=etcd,
            )
        )
    else:
        writer = frame.writeStream.foreachBatch(naive_writer(spec, url))
    started = time.perf_counter()
    before = cpu_snapshot()
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    query.awaitTermination()
    wall = time.perf_counter() - started
    breakdown, busy = cpu_breakdown(before, cpu_snapshot())
    if query.exception() is not None:
        raise SystemExit(f"{method}: the query failed: {query.exception()}")
    batches = [p for p in query.recentProgress if p.numInputRows > 0]
    rows = sum(p.numInputRows for p in batches)
    seconds = sum(p.batchDuration for p in batches) / 1000
    return Run(method, 0, rows, seconds, wall, breakdown=breakdown, busy=busy)


def measure(
    spark: SparkSession,
    registry: Registry,
    method: str,
    sources: dict[str, Path],
    args: argparse.Namespace,
    etcd: str,
) -> Run:
    spec = StreamSpec(f"bench-spark-{method}-{uuid.uuid4().hex[:8]}", args.partitions, "quorum")
    admin.create_stream(registry, args.amqp_url, spec)
    try:
        if method in ("raw", "task"):
            work = Workload(
                keys=[f"key-{i}" for i in range(args.keys)],
                body=b"x" * args.size,
                partitions=args.partitions,
                window=1000,
            )
            publish = publish_pipelined if method == "raw" else publish_rows_task
            seconds, cpu = publish(args.amqp_url, spec, args.rows, work)
            run = Run(method, 0, args.rows, seconds, seconds, cpu=cpu)
        else:
            source = sources["naive" if method == "naive" else "full"]
            run = run_query(spark, method, spec, source, args.amqp_url, etcd)
        depth = queue_depth(args.amqp_url, spec)
        if depth != run.rows:
            raise SystemExit(f"{method}: {run.rows} rows but {depth} messages in the queues")
    finally:
        admin.delete(registry, args.amqp_url, spec.name)
    return run


# -- reporting ---------------------------------------------------------------------------------


def report(runs: list[Run], args: argparse.Namespace, rabbit: str, command: str) -> str:
    def median(method: str, cores: int, attr: str = "rate") -> float:
        values = [getattr(r, attr) for r in runs if r.method == method and r.cores == cores]
        return statistics.median(values) if values else float("nan")

    naive = [r.rate for r in runs if r.method == "naive"]
    naive_note = (
        f" The naive sink ran {args.naive_rows:,} rows per run (it is slow); its rate is as "
        f"measured, i.e. {args.rows:,} rows would take ≈ {args.rows / statistics.median(naive):,.0f} s."
        if naive
        else ""
    )
    lines = [
        SECTION,
        "",
        f"Command: `{command}` — run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
        f"RabbitMQ {rabbit}, PySpark {pyspark.__version__} (`local[N]`, "
        f"`spark.sql.shuffle.partitions={args.tasks}`), Python {platform.python_version()}, "
        f"pika {pika.__version__}; {os.cpu_count()} cores ({cpu_model()}) **shared** with the "
        f"broker, etcd and other engineers' work, so absolute numbers are noisy and ratios are "
        f"taken within one run.",
        "",
        f"Workload: {args.rows:,} rows × {args.size} B body (`valueColumn` = a {args.size}-character "
        f"string), {args.keys:,} keys, P = {args.partitions} quorum queues, persistent, mandatory, "
        f"publisher confirms; window 1000. Spark rate = rows / the micro-batch's duration as Spark "
        f"reports it (read JSON, partition UDF, shuffle, publish, every confirm, commit); raw = first "
        f"publish → last confirm. For each Spark core count, the methods run interleaved "
        f'{args.repeats} times (after a warm-up query) and the table shows medians; "÷ raw" '
        f"divides by the raw pika runs of the same phase.{naive_note}",
        "",
        "| publisher | Spark cores | rows/run | rows/s | rows/s per Spark core | per core ÷ raw pika | query wall time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cores in args.cores:
        raw = median("raw", cores)
        for method in METHODS:
            if not any(r.method == method and r.cores == cores for r in runs):
                continue
            rate = median(method, cores)
            rows = args.naive_rows if method == "naive" else args.rows
            wall = median(method, cores, "wall")
            if method in ("raw", "task"):
                lines.append(
                    f"| {LABELS[method]} | (during local[{cores}]) | {rows:,} | {rate:,.0f} | — | {rate / raw:.2f} | {wall:.1f} |"
                )
                continue
            per_core = rate / cores
            lines.append(
                f"| {LABELS[method]} | {cores} | {rows:,} | {rate:,.0f} | {per_core:,.0f} | **{per_core / raw:.2f}** | {wall:.1f} |"
            )
    task_rows = [(c, r) for c in args.cores for r in runs if r.method == "task" and r.cores == c]
    if task_rows:
        lines += [
            "",
            "The per-task publisher without Spark against the raw loop, same phase (medians; CPU = "
            "this process's CPU seconds per 10k messages):",
            "",
            "| phase | raw msg/s | `publish_task` msg/s | task ÷ raw | CPU s/10k raw | CPU s/10k task |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for cores in args.cores:
            raw, task = median("raw", cores), median("task", cores)
            raw_cpu = median("raw", cores, "cpu") / args.rows * 10_000
            task_cpu = median("task", cores, "cpu") / args.rows * 10_000
            lines.append(
                f"| local[{cores}] | {raw:,.0f} | {task:,.0f} | **{task / raw:.2f}** "
                f"| {raw_cpu:.3f} | {task_cpu:.3f} |"
            )
    spark_runs = [r for r in runs if r.breakdown]
    if spark_runs:
        lines += [
            "",
            "Where the CPU went during the Spark runs (medians, CPU seconds per run; busy = "
            f"share of all {os.cpu_count()} cores busy over the query, from /proc/stat):",
            "",
            "| publisher | Spark cores | " + " | ".join(GROUPS) + " | busy | query wall (s) |",
            "|---|---:|" + "---:|" * (len(GROUPS) + 2),
        ]
        for cores in args.cores:
            for method in ("sink", "foreach", "naive"):
                mine = [r for r in spark_runs if r.method == method and r.cores == cores]
                if not mine:
                    continue
                cells = [
                    f"{statistics.median(dict(r.breakdown)[g] for r in mine):.1f}" for g in GROUPS
                ]
                busy = statistics.median(r.busy for r in mine)
                wall = statistics.median(r.wall for r in mine)
                lines.append(
                    f"| {LABELS[method]} | {cores} | {' | '.join(cells)} | {busy:.0%} | {wall:.1f} |"
                )
    lines += ["", f"Load average (1 min) at the end: {os.getloadavg()[0]:.2f}."]
    lines += ["", "Every run (rows/s):", ""]
    for cores in args.cores:
        for method in METHODS:
            rates = ", ".join(
                f"{r.rate:,.0f}" for r in runs if r.method == method and r.cores == cores
            )
            if rates:
                lines.append(f"- local[{cores}], {LABELS[method]}: {rates}")
    return "\n".join(lines)


def write_section(section: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# partq benchmarks\n"
    start = text.find(SECTION)
    notes = ""
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        end = len(text) if end < 0 else end + 1
        old = text[start:end]
        if NOTES in old:
            notes = "\n" + old[old.index(NOTES) :].rstrip() + "\n"
        text = (
            text[:start] + section + "\n" + notes + ("\n" if end < len(text) else "") + text[end:]
        )
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spark_sink", description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--naive-rows", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=200, help="body bytes")
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--cores", default="2,1", help="Spark local[N] values, one phase each")
    parser.add_argument("--tasks", type=int, default=4, help="spark.sql.shuffle.partitions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--amqp-url", default=os.environ.get("PARTQ_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--no-write", action="store_true", help="print, do not edit the docs")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    args.cores = [int(c) for c in args.cores.split(",") if c]
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.spark_sink", *sys.argv[1:]])
    rabbit = rabbitmq_version(args.amqp_url)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="partq-bench-") as tmp, LocalEtcd() as etcd:
        sources = {
            "full": Path(tmp) / "full",
            "naive": Path(tmp) / "naive",
            "warm": Path(tmp) / "warm",
        }
        write_rows(sources["full"], args.rows, args.keys, args.size)
        write_rows(sources["naive"], args.naive_rows, args.keys, args.size)
        write_rows(sources["warm"], 5_000, args.keys, args.size)
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint))
        try:
            for cores in args.cores:
                spark = loopback_session(
                    "partq-bench",
                    master=f"local[{cores}]",
                    conf={
                        "spark.ui.enabled": "false",
                        "spark.sql.shuffle.partitions": str(args.tasks),
                    },
                )
                spark.sparkContext.setLogLevel("ERROR")
                try:
                    log(f"local[{cores}]: warm-up")
                    measure(spark, registry, "sink", {"full": sources["warm"]}, args, etcd.endpoint)
                    for repeat in range(args.repeats):
                        for method in methods:
                            if method == "naive" and cores != args.cores[0]:
                                continue  # slow, and bound by round trips, not cores
                            run = replace(
                                measure(spark, registry, method, sources, args, etcd.endpoint),
                                cores=cores,
                            )
                            runs.append(run)
                            log(
                                f"local[{cores}] {method:8} #{repeat + 1}: {run.rows:>7,} rows in {run.seconds:6.2f}s = {run.rate:>8,.0f} rows/s (wall {run.wall:.1f}s)"
                            )
                finally:
                    spark.stop()
        finally:
            registry.close()
    section = report(runs, args, rabbit, command)
    print(section)
    if not args.no_write:
        write_section(section)
        log(f"wrote {SECTION!r} in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
