"""Key-level concurrency: an I/O-bound handler (sleeps 20 ms) with ``--concurrency`` 1 vs N.

    .venv/bin/python -m benchmarks.concurrency [--messages 6000] [--concurrency 1,64]

For each handler (``sleep_sync``: ``time.sleep``; ``sleep_async``: ``async def`` with
``asyncio.sleep``) and each concurrency: a fresh P = 12 quorum stream is pre-filled with
``--messages`` messages over 1,000 uniform keys, then drained by one ``partq consume``
(with a coordinator), counted from its ``/metrics``. Rate = messages / (last handled -
first handled). Prints one Markdown row per run and the 1-minute load average.
Uses a private etcd and the machine's RabbitMQ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.consume import metric_handled
from benchmarks.groups import AMQP, Bench
from consumers.message import Message
from kernel.local import LocalEtcd, free_port
from producer.contract import StreamSpec
from producer.publisher import Producer

P = 12
KEYS = 1000
WORK = 0.02  # seconds each handler call waits


def sleep_sync(message: Message) -> None:
    time.sleep(WORK)


async def sleep_async(message: Message) -> None:
    await asyncio.sleep(WORK)


def prefill(spec: StreamSpec, n: int) -> None:
    with Producer(spec, amqp_url=AMQP, window=1000) as producer:
        for start in range(0, n, 1000):
            stop = min(n, start + 1000)
            producer.publish_many((f"key-{i % KEYS}", b"x" * 100) for i in range(start, stop))
        producer.flush(600)


def drain(b: Bench, spec: StreamSpec, n: int, handler: str, concurrency: int) -> float:
    """Messages per second one consumer handles ``spec``'s ``n`` messages at."""
    port = free_port()
    coordinator = b.coordinator(spec, settle=0.2)
    consumer = b.consumer(
        spec,
        "c1",
        b.dir / "none.jsonl",
        prefetch=100,
        handler=f"benchmarks.concurrency:{handler}",
        http_port=port,
        PARTQ_CONCURRENCY=str(concurrency),
    )
    first = done = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and done is None:
        got = 0.0
        with contextlib.suppress(Exception):
            got = metric_handled(port)
        now = time.time()
        if first is None and got > 0:
            first = now
        if got >= n:
            done = now
        if consumer.poll() is not None:
            raise RuntimeError(f"the consumer exited with {consumer.returncode}")
        time.sleep(0.05)
    b.stop([consumer, coordinator])
    assert first is not None and done is not None, "the consumer did not finish"
    return n / (done - first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.concurrency", description=__doc__)
    ap.add_argument("--messages", type=int, default=6000)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--handlers", default="sleep_sync,sleep_async")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}", flush=True)
    print("| handler | --concurrency | msg/s | load (1 min) |\n|---|---|---|---|", flush=True)
    with LocalEtcd() as etcd:
        b = Bench(etcd, Path(tempfile.mkdtemp(prefix="partq-bench-concurrency-")))
        for handler in args.handlers.split(","):
            for level in levels:
                spec = b.stream(f"cc-{level}", P, "quorum")
                try:
                    prefill(spec, args.messages)
                    rate = drain(b, spec, args.messages, handler, level)
                finally:
                    b.drop(spec)
                load = os.getloadavg()[0]
                print(f"| `{handler}` | {level} | {rate:.0f} | {load:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
