"""What a published message costs, measured apart from the load: AsyncProducer and Producer.

Run: ``.venv/bin/python -m benchmarks.publish_cost --bridge`` (seconds) or
``.venv/bin/python -m benchmarks.publish_cost --methods sdk,async --messages 1000,9000``.

Wall-clock rates and even CPU seconds move with the machine's load; the number of
instructions a process executes moves less. For each method of
``benchmarks.publish`` and each message count it runs one child process under
``valgrind --tool=callgrind`` that declares a fresh stream (no etcd: the spec is given),
publishes that many messages with that method and deletes the stream, and reads the
child's total instruction count. The cost per message is the slope between two counts
(``(I(n2) - I(n1)) / (n2 - n1)``): start-up, imports and connecting cancel out. Every
thread of the child is counted (callgrind runs them one at a time, so the I/O thread
batches differently than at full speed: compare methods in the same run). Needs
valgrind and the machine's RabbitMQ; slow (about 50 times the plain run). On this
2-core machine ``sdk`` alone gave 68k-91k instructions per message over four runs: the
I/O thread batches differently each time, so differences under 20% do not show.

``--bridge`` measures instead what :class:`AsyncProducer` adds on its loop's thread,
alone: ``send`` (or ``send_many`` of 100) against a stand-in Producer that only makes
the futures, then settling them as confirm frames of 4 would, garbage collection off,
the best of 5 rounds of CPU time. No broker, no valgrind; seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import timeit
import uuid

from partq.producer import AsyncProducer, Receipt, StreamSpec
from partq.producer.futures import PublishFuture
from partq.producer.publisher import BatchItem
from partq.producer.topology import declare_stream, delete_stream

from benchmarks.publish import PUBLISHERS, TIMES, Workload
from partq.kernel.amqp import DEFAULT_AMQP_URL, blocking_connection

_TOTAL = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def child(url: str, method: str, n: int) -> None:
    """Publish n messages with one method on a fresh quorum stream, then delete it."""
    work = Workload(
        keys=[f"key-{i}" for i in range(10_000)], body=b"x" * 200, partitions=8, window=1000
    )
    spec = StreamSpec(f"bench-cost-{uuid.uuid4().hex[:8]}", work.partitions, "quorum")
    with blocking_connection(url, name="bench-cost") as connection:
        declare_stream(connection, spec)
    try:
        PUBLISHERS[method](url, spec, n, work)
    finally:
        with blocking_connection(url, name="bench-cost") as connection:
            delete_stream(connection, spec)


def instructions(url: str, method: str, n: int) -> int:
    """The child's instruction count under callgrind (every thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        command = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
            sys.executable, "-m", "benchmarks.publish_cost", "--child", method, str(n),
            "--amqp-url", url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed:\n{done.stderr[-2000:]}")
        with open(out) as f:
            found = _TOTAL.search(f.read())
    if found is None:
        raise SystemExit(f"no instruction total in callgrind's output for {method} {n}")
    return int(found.group(1))


class _StandIn:
    """What AsyncProducer calls of a Producer, making futures and nothing else."""

    def __init__(self) -> None:
        self.made: list[PublishFuture[Receipt]] = []

    def publish(self, key: object, body: object, **_: object) -> PublishFuture[Receipt]:
        future: PublishFuture[Receipt] = PublishFuture()
        self.made.append(future)
        return future

    def _prepare_batch(self, items: list[BatchItem], now: float) -> list[PublishFuture[Receipt]]:
        return [PublishFuture() for _ in items]

    def close(self, timeout: float | None = None) -> None:
        pass

    def _hand_over(self, chunk: list[PublishFuture[Receipt]]) -> list[PublishFuture[Receipt]]:
        self.made += chunk
        return chunk


async def _bridge_round(n: int, many: bool) -> tuple[float, float]:
    """CPU seconds per message: handing n messages over, then settling them."""
    producer = AsyncProducer(StreamSpec("bench", 8), amqp_url="amqp://127.0.0.1", window=n + 1)
    stand_in = _StandIn()
    producer._connect = lambda: stand_in  # type: ignore[assignment]
    await producer.open()
    batch: list[BatchItem] = [("key", b"body")] * 100
    started = time.process_time()
    if many:
        futures = [f for _ in range(n // 100) for f in await producer.send_many(batch)]
    else:
        futures = [await producer.send("key", b"body") for _ in range(n)]
    handed = time.process_time()
    receipt = Receipt("id", 0)
    for future in stand_in.made:
        future.set_result(receipt)
    for start in range(0, len(stand_in.made), 4):
        producer._on_settled(stand_in.made[start : start + 4])
    settling = time.process_time()
    producer._settle()
    settled = time.process_time()
    assert all(future.done() for future in futures)
    await producer.close()
    return (handed - started) / n, (settled - settling) / n


def bridge(n: int) -> None:
    """Print what AsyncProducer's loop thread spends per message of its own."""
    made = timeit.repeat(PublishFuture, number=n, repeat=5, timer=time.process_time)
    print(f"a PublishFuture alone (the stand-in's work): {min(made) / n * 1e6:.3f} µs")
    gc.disable()
    try:
        for many in (False, True):
            rounds = [asyncio.run(_bridge_round(n, many)) for _ in range(5)]
            hand, settle = (min(r[i] for r in rounds) * 1e6 for i in (0, 1))
            name = "send_many of 100" if many else "send"
            print(f"{name}: {hand:.3f} µs to hand over, {settle:.3f} µs to settle, per message")
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publish_cost", description=__doc__)
    parser.add_argument("--methods", default="sdk,async,sdk-many,async-many")
    parser.add_argument("--messages", default="1000,9000", help="two message counts, n1,n2")
    parser.add_argument("--amqp-url", default=os.environ.get("PARTQ_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--bridge", action="store_true", help="AsyncProducer's own work only")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.amqp_url, args.child[0], int(args.child[1]))
        return 0
    if args.bridge:
        bridge(100_000)
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(PUBLISHERS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(PUBLISHERS)}")
    n1, n2 = (int(x) for x in args.messages.split(","))
    if not 0 < n1 < n2:
        parser.error("--messages takes two counts, the first smaller: e.g. 1000,9000")
    per_message: dict[str, float] = {}
    for method in methods:
        low, high = instructions(args.amqp_url, method, n1), instructions(args.amqp_url, method, n2)
        per_message[method] = (high - low) / (n2 - n1)
        print(f"{method:10} {low:>14,} at {n1:,}, {high:>14,} at {n2:,}", file=sys.stderr)
    print("| method | instructions per message | ÷ sdk |")
    print("|---|---:|---:|")
    base = per_message.get("sdk")
    for method, cost in per_message.items():
        ratio = f"{cost / base:.2f}{TIMES}" if base else "-"
        print(f"| {method} | {cost:,.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
