"""Publish throughput: the partq Producer SDK against raw pika, per queue type.

Run: ``.venv/bin/python -m benchmarks.publish --messages 100000 --size 200``

Starts a private etcd (``partq.kernel.local.LocalEtcd``) and uses the machine's
RabbitMQ. For each queue type, on a fresh stream of P partitions per run, it
times, from the first publish to the last confirm:

* ``sdk``       — ``producer.Producer.publish``, one call per message (its I/O
  thread, window ``--window``);
* ``sdk-many``  — ``producer.Producer.publish_many``, ``--batch`` messages a call;
* ``async``     — ``producer.AsyncProducer.send``, one call per message, in an asyncio
  event loop, then ``flush`` (the same Producer underneath, bridged to asyncio futures);
* ``async-many`` — ``producer.AsyncProducer.send_many``, ``--batch`` messages a call;
* ``pipelined`` — raw pika ``SelectConnection``, publisher confirms handled in a
  callback, at most ``--window`` unconfirmed (the best a hand-written loop does);
* ``bare``      — the same raw pipelined loop, but every message carries one
  prebuilt ``BasicProperties(delivery_mode=2)``: no headers, no message id, no
  timestamp (the floor of a pika publisher; only the key's hash is computed, to
  route to the same queues);
* ``wait-each`` — raw pika ``BlockingConnection`` with ``confirm_delivery``,
  waiting for each confirm; it runs ``--wait-each-messages`` messages only (it
  is ~1.5k msg/s), and its rate is reported as it is.

Every loop but ``bare`` does the same per-message work as the SDK: hash the key with
``partition_for``, persistent properties with key/partition headers, a fresh
``message_id`` and a timestamp (``partq.producer.properties.message_properties``), and a
``mandatory`` publish. Each measurement is repeated ``--repeats`` times,
interleaved (sdk, sdk-many, async, async-many, pipelined, bare, wait-each, sdk, …) so
drifting load hits all alike; the table shows the median. Not a test: it asserts only that every
message was confirmed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

import pika
from partq.coordinator.ops import admin
from partq.producer import AsyncProducer, Producer, Receipt, StreamSpec, partition_for
from partq.producer.contract import QueueType
from partq.producer.properties import message_properties
from partq.producer.registry import Registry
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from partq.kernel.amqp import DEFAULT_AMQP_URL, blocking_connection
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

METHODS = ("sdk", "sdk-many", "async", "async-many", "pipelined", "bare", "wait-each")
TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class Run:
    queue_type: str
    method: str
    messages: int
    seconds: float
    cpu_seconds: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


@dataclass(frozen=True)
class Workload:
    keys: list[str]
    body: bytes
    partitions: int
    window: int
    batch: int = 100

    def key(self, i: int) -> str:
        return self.keys[i % len(self.keys)]


# -- the three publishers; each returns (wall seconds, cpu seconds) --------------------------


def publish_sdk(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """``Producer.publish``, one call per message."""

    def one_by_one(producer: Producer) -> list[Future[Receipt]]:
        return [producer.publish(work.key(i), work.body) for i in range(n)]

    return _sdk(url, spec, n, work, "sdk", one_by_one)


def publish_sdk_many(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """``Producer.publish_many``, ``work.batch`` messages per call."""

    def in_batches(producer: Producer) -> list[Future[Receipt]]:
        futures: list[Future[Receipt]] = []
        for start in range(0, n, work.batch):
            stop = min(n, start + work.batch)
            futures += producer.publish_many((work.key(i), work.body) for i in range(start, stop))
        return futures

    return _sdk(url, spec, n, work, "sdk-many", in_batches)


def _sdk(
    url: str,
    spec: StreamSpec,
    n: int,
    work: Workload,
    method: str,
    publish_all: Callable[[Producer], list[Future[Receipt]]],
) -> tuple[float, float]:
    with Producer(spec, amqp_url=url, window=work.window, name=f"bench-{method}") as producer:
        cpu0, t0 = time.process_time(), time.perf_counter()
        futures = publish_all(producer)
        producer.flush(timeout=600)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    failed = sum(1 for f in futures if f.exception() is not None)
    if failed:
        raise SystemExit(f"{method}: {failed} of {n} messages failed")
    return elapsed, cpu


def publish_async(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """``AsyncProducer.send``, one call per message, then ``flush``."""

    async def one_by_one(producer: AsyncProducer) -> list[asyncio.Future[Receipt]]:
        return [await producer.send(work.key(i), work.body) for i in range(n)]

    return asyncio.run(_async(url, spec, n, work, "async", one_by_one))


def publish_async_many(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """``AsyncProducer.send_many``, ``work.batch`` messages per call, then ``flush``."""

    async def in_batches(producer: AsyncProducer) -> list[asyncio.Future[Receipt]]:
        futures: list[asyncio.Future[Receipt]] = []
        for start in range(0, n, work.batch):
            stop = min(n, start + work.batch)
            futures += await producer.send_many(
                (work.key(i), work.body) for i in range(start, stop)
            )
        return futures

    return asyncio.run(_async(url, spec, n, work, "async-many", in_batches))


async def _async(
    url: str,
    spec: StreamSpec,
    n: int,
    work: Workload,
    method: str,
    publish_all: Callable[[AsyncProducer], Awaitable[list[asyncio.Future[Receipt]]]],
) -> tuple[float, float]:
    name = f"bench-{method}"
    async with AsyncProducer(spec, amqp_url=url, window=work.window, name=name) as producer:
        cpu0, t0 = time.process_time(), time.perf_counter()
        futures = await publish_all(producer)
        await producer.flush(timeout=600)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    failed = sum(1 for f in futures if f.exception() is not None)
    if failed:
        raise SystemExit(f"{method}: {failed} of {n} messages failed")
    return elapsed, cpu


_BARE = pika.BasicProperties(delivery_mode=2)


def publish_pipelined(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """Raw pika: one SelectConnection, confirms in a callback, ``window`` in flight."""
    return _pipelined(url, spec, n, work, message_properties)


def publish_bare(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """Raw pika as ``pipelined``, one prebuilt persistent ``BasicProperties`` for every message."""
    return _pipelined(url, spec, n, work, lambda _key, _partition: _BARE)


def _pipelined(
    url: str,
    spec: StreamSpec,
    n: int,
    work: Workload,
    properties: Callable[[str, int], pika.BasicProperties],
) -> tuple[float, float]:
    state = {"sent": 0, "confirmed": 0, "failed": 0, "t0": 0.0, "cpu0": 0.0}
    unconfirmed: dict[int, None] = {}  # insertion-ordered by delivery tag
    exchange = spec.exchange
    channel_box: list[Channel] = []

    def fill() -> None:
        channel = channel_box[0]
        while state["sent"] < n and len(unconfirmed) < work.window:
            i = int(state["sent"])
            key = work.key(i)
            partition = partition_for(key, work.partitions)
            channel.basic_publish(
                exchange,
                str(partition),
                work.body,
                properties(key, partition),
                mandatory=True,
            )
            state["sent"] += 1
            unconfirmed[int(state["sent"])] = None

    def on_confirm(frame: pika.frame.Method) -> None:
        method = frame.method
        if method.multiple:
            tags = []
            for tag in unconfirmed:  # ascending: inserted in tag order
                if tag > method.delivery_tag:
                    break
                tags.append(tag)
        else:
            tags = [method.delivery_tag] if method.delivery_tag in unconfirmed else []
        for tag in tags:
            del unconfirmed[tag]
        if isinstance(method, pika.spec.Basic.Nack):
            state["failed"] += len(tags)
        state["confirmed"] += len(tags)
        if state["confirmed"] >= n:
            state["t1"] = time.perf_counter()
            state["cpu1"] = time.process_time()
            channel_box[0].connection.close()
        else:
            fill()

    def on_return(*_args: object) -> None:
        state["failed"] += 1

    def on_channel(channel: Channel) -> None:
        channel_box.append(channel)
        channel.add_on_return_callback(on_return)
        channel.confirm_delivery(on_confirm)
        state["cpu0"], state["t0"] = time.process_time(), time.perf_counter()
        fill()

    params = pika.URLParameters(url)
    connection = SelectConnection(
        params,
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=lambda _c, e: sys.exit(f"pipelined: cannot connect: {e}"),
        on_close_callback=lambda c, _r: c.ioloop.stop(),
    )
    try:
        connection.ioloop.start()
    finally:
        connection.ioloop.close()
    if state["failed"] or state["confirmed"] != n:
        raise SystemExit(f"pipelined: {state['failed']} failed, {state['confirmed']} of {n}")
    return state["t1"] - state["t0"], state["cpu1"] - state["cpu0"]


def publish_wait_each(url: str, spec: StreamSpec, n: int, work: Workload) -> tuple[float, float]:
    """Raw pika: BlockingConnection with confirm_delivery, each publish waits for its confirm."""
    with blocking_connection(url, name="bench-wait-each") as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        exchange = spec.exchange
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            key = work.key(i)
            partition = partition_for(key, work.partitions)
            # raises UnroutableError / NackError: nothing to count
            channel.basic_publish(
                exchange,
                str(partition),
                work.body,
                message_properties(key, partition),
                mandatory=True,
            )
        return time.perf_counter() - t0, time.process_time() - cpu0


PUBLISHERS: dict[str, Callable[[str, StreamSpec, int, Workload], tuple[float, float]]] = {
    "sdk": publish_sdk,
    "sdk-many": publish_sdk_many,
    "async": publish_async,
    "async-many": publish_async_many,
    "pipelined": publish_pipelined,
    "bare": publish_bare,
    "wait-each": publish_wait_each,
}


# -- driving and reporting ---------------------------------------------------------------------


def queue_depth(url: str, spec: StreamSpec) -> int:
    with blocking_connection(url, name="bench-check") as connection:
        channel = connection.channel()
        return sum(
            channel.queue_declare(spec.queue(p), passive=True).method.message_count
            for p in range(spec.partitions)
        )


def measure(
    registry: Registry,
    url: str,
    queue_type: QueueType,
    method: str,
    n: int,
    work: Workload,
) -> Run:
    spec = StreamSpec(f"bench-{method}-{uuid.uuid4().hex[:8]}", work.partitions, queue_type)
    admin.create_stream(registry, url, spec)
    try:
        seconds, cpu = PUBLISHERS[method](url, spec, n, work)
        depth = queue_depth(url, spec)
        if depth != n:
            raise SystemExit(f"{method}: {n} confirmed but {depth} in the queues")
    finally:
        admin.delete(registry, url, spec.name)  # queues and their messages
    return Run(queue_type, method, n, seconds, cpu)


def rabbitmq_version(url: str) -> str:
    with blocking_connection(url, name="bench-version") as connection:
        props = connection._impl.server_properties
    version = props.get("version", b"?")
    return version.decode() if isinstance(version, bytes) else str(version)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def report(
    runs: list[Run], args: argparse.Namespace, rabbit: str, command: str, load: list[str]
) -> str:
    methods = [m for m in METHODS if any(r.method == m for r in runs)]
    lines = [
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load average "
        f"(1 min) {' → '.join(load)} (start → end)",
        f"- machine: {os.cpu_count()} cores ({cpu_model()}), shared with the broker"
        f" and other work; Python {platform.python_version()}, pika {pika.__version__}",
        f"- RabbitMQ {rabbit} on 127.0.0.1; {args.messages:,} {TIMES} {args.size}-byte persistent "
        f"messages, mandatory, {args.keys:,} keys over P={args.partitions} partitions, "
        f"window {args.window}; sdk-many and async-many: {args.batch} messages per call; "
        f"wait-each: {args.wait_each_messages:,} messages",
        f"- median of {args.repeats} runs, each on a fresh stream, methods interleaved (msg/s; "
        f"CPU = this process's CPU seconds per 10k messages, every thread: robust to load)",
        "",
        "| queue type | method | msg/s | ÷ sdk | ÷ pipelined | ÷ bare | CPU s/10k "
        "| CPU ÷ sdk's | CPU ÷ pipelined's | CPU ÷ bare's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for queue_type in args.queue_types:

        def median(method: str, qt: str = queue_type) -> float:
            values = [r.rate for r in runs if r.queue_type == qt and r.method == method]
            return statistics.median(values) if values else float("nan")

        def cpu(method: str, qt: str = queue_type) -> float:
            values = [
                r.cpu_seconds / r.messages * 10_000
                for r in runs
                if r.queue_type == qt and r.method == method
            ]
            return statistics.median(values) if values else float("nan")

        for method in methods:
            rate, used = median(method), cpu(method)
            rates = " | ".join(_ratio(rate, median(base), TIMES) for base in _BASES)
            cpus = " | ".join(_ratio(used, cpu(base)) for base in _BASES)
            lines.append(
                f"| {queue_type} | {method} | {rate:,.0f} | {rates} | {used:.3f} | {cpus} |"
            )
    lines.append("")
    lines.append("Every run (msg/s, CPU s/10k):")
    lines.append("")
    for queue_type in args.queue_types:
        for method in methods:
            cells = [
                f"{r.rate:,.0f} ({r.cpu_seconds / r.messages * 10_000:.3f})"
                for r in runs
                if r.queue_type == queue_type and r.method == method
            ]
            if cells:
                lines.append(f"- {queue_type} {method}: {', '.join(cells)}")
    return "\n".join(lines)


_BASES = ("sdk", "pipelined", "bare")  # what the ratio columns divide by


def _ratio(value: float, base: float, unit: str = "") -> str:
    """``value / base`` to two places, or a dash when the base method did not run."""
    return "-" if math.isnan(base) or math.isnan(value) else f"{value / base:.2f}{unit}"


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publish", description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=200, help="body bytes")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--keys", type=int, default=10_000, help="distinct keys")
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=100, help="messages per publish_many")
    parser.add_argument("--wait-each-messages", type=int, default=10_000)
    parser.add_argument("--queue-types", default="quorum,classic")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--amqp-url", default=os.environ.get("PARTQ_AMQP_URL", DEFAULT_AMQP_URL))
    args = parser.parse_args(argv)
    args.queue_types = [q.strip() for q in args.queue_types.split(",") if q.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.publish", *sys.argv[1:]])
    work = Workload(
        keys=[f"key-{i}" for i in range(args.keys)],
        body=os.urandom(args.size),
        partitions=args.partitions,
        window=args.window,
        batch=args.batch,
    )
    load = [load_average()]
    rabbit = rabbitmq_version(args.amqp_url)
    runs: list[Run] = []
    with LocalEtcd() as etcd:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint))
        try:
            for queue_type in args.queue_types:
                for repeat in range(args.repeats):
                    for method in methods:
                        n = args.wait_each_messages if method == "wait-each" else args.messages
                        run = measure(registry, args.amqp_url, queue_type, method, n, work)
                        runs.append(run)
                        print(
                            f"{queue_type:8} {method:10} #{repeat + 1}: {run.messages:>7,} in "
                            f"{run.seconds:6.2f}s = {run.rate:>8,.0f} msg/s "
                            f"(cpu {run.cpu_seconds:.2f}s)",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            registry.close()
    load.append(load_average())
    print(report(runs, args, rabbit, command, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
