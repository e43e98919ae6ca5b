# ruff: noqa: E501  (report lines)
"""Which way of dropping a single-active-consumer owner gives its unacked messages back first?

    .venv/bin/python -m benchmarks.fence_order                       # the machine's RabbitMQ
    .venv/bin/python -m benchmarks.fence_order --rabbitmq 4.0.5      # a private 4.0.5 node

Per queue type (quorum and classic, declared by ``partq.producer.topology.declare_stream`` as
partq declares a partition queue: single active consumer; quorum with its delivery limit)
and per way of going away, on a fresh one-partition stream:

1. ``3 * --window`` messages are published (body: their number, 0, 1, ...), confirmed;
2. consumer A (its own connection, prefetch ``--window``) receives messages 0 … window-1
   and acks none of them;
3. consumer B (its own connection, same prefetch) subscribes and waits behind A;
4. A goes away by one of: ``channel.close``; ``connection.close``; ``basic.cancel`` then
   ``channel.close``; or aborting its TCP socket (``partq.kernel.amqp.abort_connection``:
   ``shutdown(SHUT_RDWR)`` on pika's socket, no AMQP close; what a kill -9 does to the
   broker, and what partq's fence does);
5. B acks everything it gets until it has had every message; its delivery order is
   reported as ranges (``0-19, 20-59`` is A's messages first, in order).

"A's first, in order" means B's first ``window`` deliveries are exactly 0 … window-1.
``--rabbitmq 4.0.5`` starts a private node from the cached trixie tree
(``tests/rabbit.py``: ``tree_rabbit``) and stops it by PID at the end. Every wait is
bounded (``--timeout`` seconds per step). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pika
import pika.exceptions
from partq.producer.contract import StreamSpec
from partq.producer.topology import declare_stream, delete_stream

from partq.kernel.amqp import abort_connection

WAYS = ("channel-close", "connection-close", "cancel-close", "socket-abort")


@dataclass(frozen=True)
class Outcome:
    queue_type: str
    way: str
    order: list[int]
    redelivered_first: int  # of B's first `window` deliveries, how many were redelivered
    window: int
    total: int

    @property
    def owner_first(self) -> bool:
        return self.order[: self.window] == list(range(self.window))

    @property
    def complete(self) -> bool:
        return sorted(self.order) == list(range(self.total))


def ranges(order: list[int]) -> str:
    """``[0, 1, 2, 7, 8]`` → ``0-2, 7-8``: runs of consecutive numbers."""
    runs: list[list[int]] = []
    for n in order:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def pump(connection: pika.BlockingConnection, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no progress within the deadline")
        connection.process_data_events(time_limit=min(0.05, left))


def go_away(way: str, connection: pika.BlockingConnection, channel: object, tag: str) -> None:
    ch: pika.adapters.blocking_connection.BlockingChannel = channel  # type: ignore[assignment]
    if way == "channel-close":
        ch.close()
    elif way == "connection-close":
        connection.close()
    elif way == "cancel-close":
        ch.basic_cancel(tag)
        ch.close()
    elif way == "socket-abort":
        abort_connection(connection._impl)  # what partq's fence does
    else:
        raise ValueError(f"unknown way {way!r}: one of {', '.join(WAYS)}")


def probe(url: str, queue_type: str, way: str, window: int, timeout: float) -> Outcome:
    spec = StreamSpec(f"fence-order-{uuid.uuid4().hex[:8]}", 1, queue_type)  # type: ignore[arg-type]
    queue = spec.queue(0)
    params = pika.URLParameters(url)
    total = 3 * window
    admin = pika.BlockingConnection(params)
    declare_stream(admin, spec)
    a = b = None
    try:
        channel = admin.channel()
        channel.confirm_delivery()
        for n in range(total):
            channel.basic_publish("", queue, str(n).encode(), pika.BasicProperties(delivery_mode=2))
        a = pika.BlockingConnection(params)
        a_channel = a.channel()
        a_channel.basic_qos(prefetch_count=window)
        held: list[int] = []
        a_tag = a_channel.basic_consume(queue, lambda _c, _m, _p, body: held.append(int(body)))
        pump(a, lambda: len(held) >= window, timeout)
        assert held == list(range(window)), f"A got {held}"
        b = pika.BlockingConnection(params)
        b_channel = b.channel()
        b_channel.basic_qos(prefetch_count=window)
        got: list[tuple[int, bool]] = []

        def on_b(ch: object, method: object, _p: object, body: bytes) -> None:
            got.append((int(body), bool(method.redelivered)))  # type: ignore[attr-defined]
            b_channel.basic_ack(method.delivery_tag)  # type: ignore[attr-defined]

        b_channel.basic_consume(queue, on_b)
        b.process_data_events(time_limit=0.3)
        assert not got, f"B was served while A was active: {got}"
        go_away(way, a, a_channel, a_tag)
        pump(b, lambda: len(got) >= total, timeout)
        order = [n for n, _ in got]
        redelivered = sum(1 for _, r in got[:window] if r)
        return Outcome(queue_type, way, order, redelivered, window, total)
    finally:
        for connection in (a, b):
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
        with contextlib.suppress(Exception):
            delete_stream(admin, spec)
        with contextlib.suppress(Exception):
            admin.close()


@contextlib.contextmanager
def broker(version: str, url: str) -> Iterator[tuple[str, str]]:
    """The URL to probe and the broker's version string."""
    node = None
    if version == "4.0.5":
        from tests.rabbit import tree_rabbit  # only this option needs the test helpers

        node = tree_rabbit().start()
        url = node.url
    try:
        with pika.BlockingConnection(pika.URLParameters(url)) as connection:
            server = connection._impl.server_properties["version"]
        yield url, server.decode() if isinstance(server, bytes) else str(server)
    finally:
        if node is not None:
            node.stop()


def heading(version: str, window: int) -> str:
    """The line above a probe's table: broker, time, window, the machine's load."""
    load = os.getloadavg()
    return (
        f"RabbitMQ {version}, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, window {window}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("PARTQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    )
    parser.add_argument("--rabbitmq", choices=("machine", "4.0.5"), default="machine")
    parser.add_argument("--window", type=int, default=20, help="A's prefetch: how many it holds")
    parser.add_argument("--runs", type=int, default=1, help="runs of each case")
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    with broker(args.rabbitmq, args.amqp_url) as (url, version):
        print(heading(version, args.window))
        print(
            "| RabbitMQ | queue | A goes away by | B's deliveries, in the order received | runs with A's back first, in order | redelivered of B's first window |"
        )
        print("|---|---|---|---|---|---|")
        for queue_type in ("quorum", "classic"):
            for way in WAYS:
                runs = [
                    probe(url, queue_type, way, args.window, args.timeout) for _ in range(args.runs)
                ]
                seen = sorted({ranges(o.order) for o in runs})
                first = sum(1 for o in runs if o.owner_first and o.complete)
                verdict = (
                    f"{first}/{len(runs)}" if first == len(runs) else f"**{first}/{len(runs)}**"
                )
                redelivered = ", ".join(sorted({f"{o.redelivered_first}/{o.window}" for o in runs}))
                print(
                    f"| {version} | {queue_type} | {way} | {'; '.join(seen)} | {verdict} | {redelivered} |"
                )


if __name__ == "__main__":
    main()
