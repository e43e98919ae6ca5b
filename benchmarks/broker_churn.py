"""Does churning consumers that hold unacked windows grow RabbitMQ's memory?

    .venv/bin/python -m benchmarks.broker_churn                   # the machine's RabbitMQ
    .venv/bin/python -m benchmarks.broker_churn --rabbitmq 4.0.5  # 4.0.5 from the cached tree

A private 3-node cluster (``tests.cluster.RabbitCluster``, stopped by PID at the end), one
stream of ``--partitions`` quorum partitions declared as partq declares them
(``partq.producer.topology.declare_stream``: single active consumer, delivery limit) and
``--messages`` messages queued. Then ``--cycles`` times what a partq owner does over its
life, as fast as it can: a connection (to node ``i % 3``), a channel with prefetch
``--window``, a consumer on partition ``i % partitions``; once it holds ``--window``
unacked deliveries it goes away, alternately by ``connection.close`` (a graceful leave)
and by aborting its socket (``partq.kernel.amqp.abort_connection``: partq's fence, and what
a kill -9 does), so the broker requeues the window. Every node's ``rabbit_vm:memory()``
(what ``rabbitmq-diagnostics memory_breakdown`` prints) is read before, every ``--every``
cycles, and after ``--settle`` seconds of quiet. It prints, per node and category, the
figures before, the largest, after, and the change per 1,000 cycles. Not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pika
from partq.producer.contract import StreamSpec
from partq.producer.topology import declare_stream

from benchmarks.chaos.broker_memory import BrokerSampler, wal_bytes
from partq.kernel.amqp import abort_connection
from tests.cluster import RabbitCluster
from tests.rabbit import MACHINE, TREE_40

SHOWN = (
    "total", "quorum_ets", "quorum_queue_procs", "binary", "connection_readers",
    "connection_writers", "connection_channels", "connection_other", "other_proc",
    "other_ets", "metrics", "wal_on_disk",
)  # fmt: skip
Figures = dict[str, dict[str, int]]  # node -> category -> bytes


def measure(sampler: BrokerSampler) -> Figures:
    found = sampler.ask()
    for node, figures in found.items():
        figures["wal_on_disk"] = wal_bytes(sampler.rabbit, node)
    return found


def fill(url: str, spec: StreamSpec, messages: int) -> None:
    """Declare the stream; queue ``messages`` small messages round-robin over its partitions."""
    with pika.BlockingConnection(pika.URLParameters(url)) as connection:
        declare_stream(connection, spec)
        channel = connection.channel()
        channel.confirm_delivery()
        body = b'{"key": "key-000", "seq": 0}'
        for n in range(messages):
            channel.basic_publish(
                "", spec.queue(n % spec.partitions), body, pika.BasicProperties(delivery_mode=2)
            )


def cycle(url: str, queue: str, window: int, abort: bool, timeout: float) -> None:
    """One owner's life: subscribe, hold ``window`` unacked deliveries, go away."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=window)
        held: list[int] = []
        channel.basic_consume(queue, lambda _c, m, _p, _b: held.append(m.delivery_tag))
        deadline = time.monotonic() + timeout
        while len(held) < window and time.monotonic() < deadline:
            connection.process_data_events(time_limit=0.05)
        if len(held) < window:
            raise TimeoutError(f"{queue}: {len(held)} of {window} deliveries in {timeout} s")
        if abort:
            abort_connection(connection._impl)
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.process_data_events(time_limit=0.1)  # pika sees the EOF
    finally:
        if connection.is_open:
            connection.close()


def mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def trend(before: Figures, series: list[Figures], after: Figures, every: int) -> list[str]:
    """Per node, ``quorum_queue_procs`` and total MiB at each sample: does it level off?"""
    lines = []
    for node in sorted(before):
        points = [before[node], *(f.get(node, {}) for f in series), after.get(node, {})]
        shown = ", ".join(
            f"{mib(f.get('quorum_queue_procs', 0))}/{mib(f.get('total', 0))}" for f in points
        )
        lines.append(f"{node}: quorum_queue_procs/total MiB every {every} lives: {shown}")
    return lines


def report(before: Figures, series: list[Figures], after: Figures, cycles: int) -> list[str]:
    lines = [
        "| node: category | before MiB | max | after settle | change per 1,000 cycles (MiB) |",
        "|---|---|---|---|---|",
    ]
    for node in sorted(before):
        for category in SHOWN:
            start = before[node].get(category, 0)
            end = after.get(node, {}).get(category, 0)
            top = max([start, end, *(f.get(node, {}).get(category, 0) for f in series)])
            per = (end - start) / 2**20 * 1000 / max(cycles, 1)
            lines.append(
                f"| {node}: {category} | {mib(start)} | {mib(top)} | {mib(end)} | {per:+.2f} |"
            )
    return lines


def main() -> None:
    ask = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ask.add_argument("--rabbitmq", choices=("machine", "4.0.5"), default="machine")
    ask.add_argument("--partitions", type=int, default=12)
    ask.add_argument("--messages", type=int, default=24_000)
    ask.add_argument("--cycles", type=int, default=1200)
    ask.add_argument("--window", type=int, default=100, help="Each owner's prefetch.")
    ask.add_argument("--every", type=int, default=200, help="Cycles between samples.")
    ask.add_argument("--settle", type=float, default=30.0)
    ask.add_argument("--timeout", type=float, default=30.0, help="Per cycle, seconds.")
    args = ask.parse_args()
    if args.messages < args.partitions * args.window:
        ask.error("--messages must fill every partition's window (partitions * window)")
    install = TREE_40 if args.rabbitmq == "4.0.5" else MACHINE
    root = Path(tempfile.mkdtemp(prefix="partq-churn-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        rabbit = stack.enter_context(RabbitCluster(root / "rabbit", install=install))
        sampler = BrokerSampler(rabbit)
        version = rabbit.ctl(rabbit.nodes[0], "version").strip()
        spec = StreamSpec(f"churn-{uuid.uuid4().hex[:6]}", args.partitions, "quorum")
        fill(rabbit.urls[0], spec, args.messages)
        load_before, began = os.getloadavg(), time.monotonic()
        before, series = measure(sampler), []
        for i in range(args.cycles):
            url = rabbit.urls[i % len(rabbit.urls)]
            cycle(url, spec.queue(i % spec.partitions), args.window, i % 2 == 1, args.timeout)
            if (i + 1) % args.every == 0:
                series.append(measure(sampler))
        churned = time.monotonic() - began
        time.sleep(args.settle)
        after = measure(sampler)
        load = os.getloadavg()
    print(
        f"RabbitMQ {version}, 3 nodes; {args.cycles} owners in {churned:.0f} s "
        f"({args.partitions} quorum partitions, window {args.window}, {args.messages} queued; "
        f"half closed, half socket-aborted); then {args.settle:.0f} s quiet; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; load average "
        f"{load_before[0]:.1f} before, {load[0]:.1f} after, {os.cpu_count()} cores\n"
    )
    print("\n".join(report(before, series, after, args.cycles)))
    print("\n" + "\n".join(trend(before, series, after, args.every)))


if __name__ == "__main__":
    main()
