"""What a consumer group costs the broker: one stream read by 1 group and by 3 groups.

    .venv/bin/python -m benchmarks.fanout [--messages 30000] [--repeats 3] [--groups 3]

For each repeat, 1 group and ``--groups`` groups alternated: a fresh P = 8 quorum stream
(and its groups, ``partq group create``) is filled with ``--messages`` persistent
200-byte messages through the SDK (one publish each: the exchange copies it to every
group), then every group's queues are drained by raw pika consumers (manual acks,
prefetch 100). Broker CPU = the machine's RabbitMQ (``beam.smp``) CPU seconds from the
first publish to the last ack, per 10k published messages; the table gives the medians
and the ratio of the two, both measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Any

import pika
from partq.coordinator.ops import admin, groups
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from benchmarks.consume import broker_cpu, load_average, log, prefill
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

AMQP = "amqp://guest:guest@127.0.0.1:5672/%2F"
PARTITIONS = 8


def drain(spec: StreamSpec, expected: int) -> None:
    """Take every message off ``spec``'s group's queues (manual acks, prefetch 100)."""
    left = expected
    with pika.BlockingConnection(pika.URLParameters(AMQP)) as connection:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=100)

        def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
            nonlocal left
            ch.basic_ack(method.delivery_tag)
            left -= 1

        for partition in range(spec.partitions):
            channel.basic_consume(spec.queue(partition), on_message)
        deadline = time.monotonic() + 600
        while left > 0 and time.monotonic() < deadline:
            connection.process_data_events(time_limit=0.5)
    if left:
        raise RuntimeError(f"{left} messages of {spec.scope} were not drained in 600 s")


def one_run(registry: Registry, group_count: int, messages: int) -> float:
    """Broker CPU seconds per 10k published messages for a stream read by ``group_count``."""
    spec = StreamSpec(f"fanout-{uuid.uuid4().hex[:8]}", PARTITIONS, "quorum")
    admin.create_stream(registry, AMQP, spec)
    try:
        names = [f"g{n}" for n in range(2, group_count + 1)]
        for name in names:
            groups.create_group(registry, AMQP, spec.name, name)
        before = broker_cpu()
        prefill(spec, messages, 200)
        for group in ["default", *names]:
            drain(spec.in_group(group), messages)
        return (broker_cpu() - before) / messages * 10_000
    finally:
        admin.delete(registry, AMQP, spec.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fanout", description=__doc__)
    ap.add_argument("--messages", type=int, default=30_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3)
    args = ap.parse_args(argv)
    load_before = load_average()
    with LocalEtcd() as etcd:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint, amqp_url=AMQP))
        figures: dict[int, list[float]] = {1: [], args.groups: []}
        for repeat in range(args.repeats):
            for count in (1, args.groups) if repeat % 2 == 0 else (args.groups, 1):
                cpu = one_run(registry, count, args.messages)
                figures[count].append(cpu)
                log(f"repeat {repeat + 1}: {count} group(s): broker {cpu:.3f} s per 10k published")
        registry.close()
    one, many = statistics.median(figures[1]), statistics.median(figures[args.groups])
    print(f"| groups | broker CPU per 10k published (median of {args.repeats}) | runs |")
    print("|---:|---:|---|")
    for count in (1, args.groups):
        runs = ", ".join(f"{v:.3f}" for v in figures[count])
        print(f"| {count} | {statistics.median(figures[count]):.3f} s | {runs} |")
    print(
        f"\n{args.groups} groups cost the broker {many / one:.2f}x one group's CPU "
        f"({args.messages:,} messages, P = {PARTITIONS}, quorum; load {load_before} -> "
        f"{load_average()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
