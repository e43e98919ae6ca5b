# ruff: noqa: E501, RUF002  (Markdown tables and the signs in them)
"""Consumer throughput: ``partq consume`` (no-op handler) against raw pika, same run.

    .venv/bin/python -m benchmarks.consume [--messages 100000] [--repeats 2]
        [--queue-types quorum,classic] [--prefetches 100,1000] [--profile DIR]

For each queue type × prefetch, and each repeat, interleaved (raw, partq, raw, …):
a fresh P = 8 stream is pre-filled with ``--messages`` × ``--size``-byte persistent
messages through the SDK, then drained by one consumer process:

* ``raw``   — pika ``BlockingConnection``, one channel per partition queue with
  ``basic_qos(prefetch)``, ``basic_consume`` and a manual ``basic_ack`` per message;
* ``partq`` — ``partq consume --handler examples.handlers:noop_handler --prefetch N``
  (with a coordinator), counted from its ``/metrics``.

Rate = messages / (last handled − first handled). CPU = the consumer process's CPU
seconds (user + system, every thread) over that same span, per 10k messages: robust to
the machine's load, which the table reports (1-minute load average at start and end).
Broker CPU = the machine's RabbitMQ (the ``rabbitmq`` user's ``beam.smp``) CPU seconds over
the same span, per 10k messages (whatever else the broker serves then counts too).
``--profile DIR`` runs ``py-spy record`` (if installed) on each partq consumer and
writes raw collapsed stacks there. Uses a private etcd and the machine's RabbitMQ.
``benchmarks.groups`` runs the same measurement as its throughput phase.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer

from benchmarks.groups import AMQP, NOOP_HANDLER, Bench, versions
from partq.kernel.local import LocalEtcd, free_port

TIMES = "\N{MULTIPLICATION SIGN}"
_TICK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:  # progress on stderr: stdout is the Markdown report
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prefill(spec: StreamSpec, n: int, size: int) -> float:
    t = time.monotonic()
    with Producer(spec, amqp_url=AMQP, window=1000) as prod:
        for start in range(0, n, 1000):
            stop = min(n, start + 1000)
            prod.publish_many((f"key-{i % 10000}", b"x" * size) for i in range(start, stop))
        prod.flush(600)
    return n / (time.monotonic() - t)


def metric_handled(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        lines = r.read().decode().splitlines()
    prefix = "partq_consumer_messages_handled_total{"
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(prefix) and '"ok"' in x)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def broker_pid() -> int | None:
    """The machine's RabbitMQ node: the ``rabbitmq`` user's one ``beam.smp`` (None if not one)."""
    pgrep = ["pgrep", "-u", "rabbitmq", "-f", "beam.smp"]
    pids = subprocess.run(pgrep, capture_output=True, text=True, check=False).stdout.split()
    return int(pids[0]) if len(pids) == 1 else None


BROKER = broker_pid()


def broker_cpu() -> float:
    """The broker's CPU seconds so far (NaN if it was not found)."""
    return process_cpu(BROKER) if BROKER is not None else float("nan")


def run_partq(
    b: Bench, spec: StreamSpec, n: int, prefetch: int, profile: Path | None = None
) -> dict[str, float]:
    port = free_port()
    coord = b.coordinator(spec, settle=0.2)
    t0 = time.time()
    c = b.consumer(
        spec, "tp1", b.dir / "none.jsonl", prefetch=prefetch, handler=NOOP_HANDLER, http_port=port
    )
    spy = None
    if profile is not None and shutil.which("py-spy"):
        profile.mkdir(parents=True, exist_ok=True)
        out = profile / f"partq-{spec.queue_type}-{prefetch}-{spec.name}.raw"
        spy_args = ["record", "--pid", str(c.pid), "--format", "raw", "-r", "200", "--nonblocking"]
        spy_args += ["--gil"]  # samples holding the GIL: where the CPU goes, not the waits
        spy = subprocess.Popen(
            ["py-spy", *spy_args, "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    t_first = t_done = None
    cpu_first = cpu_done = broker_first = broker_done = 0.0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and t_done is None:
        got = 0.0
        with contextlib.suppress(Exception):
            got = metric_handled(port)
        now = time.time()
        if t_first is None and got > 0:
            t_first, cpu_first, broker_first = now, process_cpu(c.pid), broker_cpu()
        if got >= n:
            t_done, cpu_done, broker_done = now, process_cpu(c.pid), broker_cpu()
        if c.poll() is not None:
            raise RuntimeError(f"partq consumer exited with {c.returncode}")
        time.sleep(0.05)
    if spy is not None:
        spy.send_signal(2)  # SIGINT: py-spy writes what it has
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(30)
    b.stop([c, coord])
    assert t_first is not None and t_done is not None, "partq consumer did not finish"
    return {
        "rate": n / (t_done - t_first),
        "total_s": t_done - t0,
        "startup_s": t_first - t0,
        "cpu_per_10k": (cpu_done - cpu_first) / n * 10_000,
        "broker_cpu_per_10k": (broker_done - broker_first) / n * 10_000,
    }


RAW = r"""
import json, os, sys, time, pika
url, n, prefetch, queues = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
broker, tick = int(os.environ.get("BROKER_PID") or 0), os.sysconf("SC_CLK_TCK")
def broker_cpu():
    if not broker:
        return float("nan")
    with open(f"/proc/{broker}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick
conn = pika.BlockingConnection(pika.URLParameters(url))
state = {"count": 0, "first": None, "cpu": 0.0, "broker": 0.0}
def on_message(ch, method, props, body):
    if state["first"] is None:
        state["first"] = time.time()
        state["cpu"] = time.process_time()
        state["broker"] = broker_cpu()
    ch.basic_ack(method.delivery_tag)
    state["count"] += 1
for q in queues:
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    ch.basic_consume(q, on_message)
t0 = time.time()
while state["count"] < n:
    conn.process_data_events(time_limit=0.1)
done, cpu, broker_done = time.time(), time.process_time(), broker_cpu()
print(json.dumps({"t0": t0, "first": state["first"], "done": done, "cpu": cpu - state["cpu"],
                  "broker": broker_done - state["broker"]}))
conn.close()
"""


def run_raw(spec: StreamSpec, n: int, prefetch: int) -> dict[str, float]:
    queues = [spec.queue(p) for p in range(spec.partitions)]
    t0 = time.time()
    argv = [sys.executable, "-c", RAW, AMQP, str(n), str(prefetch), *queues]
    env = {**os.environ, "BROKER_PID": str(BROKER or "")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rate = n / (r["done"] - r["first"])
    return {
        "rate": rate,
        "total_s": r["done"] - t0,
        "startup_s": r["first"] - t0,
        "cpu_per_10k": r["cpu"] / n * 10_000,
        "broker_cpu_per_10k": r["broker"] / n * 10_000,
    }


def throughput(
    b: Bench,
    n: int,
    size: int,
    *,
    repeats: int = 1,
    queue_types: tuple[str, ...] = ("quorum", "classic"),
    prefetches: tuple[int, ...] = (100, 1000),
    profile: Path | None = None,
) -> list[dict[str, Any]]:
    """One row per queue type × prefetch: medians of ``repeats`` interleaved runs each."""
    rows = []
    for queue_type in queue_types:
        for prefetch in prefetches:
            row: dict[str, Any] = {"queue_type": queue_type, "prefetch": prefetch, "runs": []}
            for _ in range(repeats):
                run: dict[str, Any] = {}
                for impl in ("raw", "partq"):
                    spec = b.stream(f"tp-{impl}", 8, queue_type)
                    run[f"{impl}_publish_rate"] = prefill(spec, n, size)
                    run[impl] = (
                        run_partq(b, spec, n, prefetch, profile)
                        if impl == "partq"
                        else run_raw(spec, n, prefetch)
                    )
                    log(
                        f"throughput {queue_type} prefetch={prefetch} {impl}: "
                        f"{run[impl]['rate']:.0f} msg/s, cpu {run[impl]['cpu_per_10k']:.3f} s/10k, "
                        f"broker cpu {run[impl]['broker_cpu_per_10k']:.3f} s/10k"
                    )
                    b.drop(spec)
                row["runs"].append(run)
            for impl in ("raw", "partq"):
                row[impl] = {
                    key: statistics.median(run[impl][key] for run in row["runs"])
                    for key in row["runs"][0][impl]
                }
            row["ratio"] = row["partq"]["rate"] / row["raw"]["rate"]
            rows.append(row)
    return rows


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; load average (1 min) {meta['load']} (start → end)",
        f"- RabbitMQ {meta['rabbitmq']}, Python {meta['python']}, partq at {meta['commit']}; "
        f"{os.cpu_count()} cores shared with the broker",
        f"- {meta['n']:,} {TIMES} {meta['size']}-byte persistent messages pre-filled into a fresh "
        f"P = 8 stream per run; one consumer process; median of {meta['repeats']} interleaved "
        "runs; CPU = the consumer process's CPU seconds (every thread) per 10k messages",
        "",
        "| queue type | prefetch | raw pika msg/s | partq msg/s | partq ÷ raw | CPU s/10k raw | CPU s/10k partq | CPU partq ÷ raw | broker CPU s/10k raw | broker CPU s/10k partq |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        raw, partq = r["raw"], r["partq"]
        lines.append(
            f"| {r['queue_type']} | {r['prefetch']} | {raw['rate']:,.0f} | {partq['rate']:,.0f} "
            f"| **{r['ratio']:.2f}{TIMES}** | {raw['cpu_per_10k']:.3f} | {partq['cpu_per_10k']:.3f} "
            f"| {partq['cpu_per_10k'] / raw['cpu_per_10k']:.2f} "
            f"| {raw['broker_cpu_per_10k']:.3f} | {partq['broker_cpu_per_10k']:.3f} |"
        )
    lines += ["", "Every run (msg/s, CPU s/10k, broker CPU s/10k):", ""]
    for r in rows:
        for impl in ("raw", "partq"):
            cells = [
                f"{run[impl]['rate']:,.0f} ({run[impl]['cpu_per_10k']:.3f}, "
                f"{run[impl]['broker_cpu_per_10k']:.3f})"
                for run in r["runs"]
            ]
            lines.append(f"- {r['queue_type']} prefetch {r['prefetch']} {impl}: {', '.join(cells)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.consume", description=__doc__)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--queue-types", default="quorum,classic")
    ap.add_argument("--prefetches", default="100,1000")
    ap.add_argument("--profile", type=Path, help="py-spy raw stacks of each partq consumer here")
    args = ap.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.consume", *sys.argv[1:]])
    workdir = Path(tempfile.mkdtemp(prefix="partq-bench-consume-"))
    load = [load_average()]
    meta: dict[str, Any] = {
        "command": command,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "n": args.messages,
        "size": args.size,
        "repeats": args.repeats,
        **versions(),
    }
    with LocalEtcd() as etcd:
        b = Bench(etcd, workdir)
        try:
            rows = throughput(
                b,
                args.messages,
                args.size,
                repeats=args.repeats,
                queue_types=tuple(q for q in args.queue_types.split(",") if q),
                prefetches=tuple(int(p) for p in args.prefetches.split(",") if p),
                profile=args.profile,
            )
        finally:
            b.stop(b.procs, timeout=15)
            b.registry.close()
    load.append(load_average())
    meta["load"] = " → ".join(load)
    print(render(rows, meta))
    (workdir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    log(f"raw results: {workdir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
