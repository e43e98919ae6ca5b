# ruff: noqa: E501  (report lines)
"""Does reading a dead-letter queue without acking keep its order (issue 23)?

    .venv/bin/python -m benchmarks.dlq_peek [--url amqp://guest:guest@127.0.0.1:5672/%2F]

For each queue kind (classic; quorum declared as partq declares a DLQ, no delivery limit;
quorum with ``x-delivery-limit`` 1000) and each way of giving messages back, a fresh queue
gets 20 confirmed messages 0..19, a reader takes some without acking, and 5 more (20..24)
are published *while it holds them*; then the messages go back and a destructive read shows
the order the queue now has. Ways of giving back:

- ``get-all``: ``basic.get`` without ack until the queue is empty (the 5 arrivals too),
  close the channel;
- ``get-some``: ``basic.get`` 5 without ack, close the channel;
- ``consume-all``: consume with no prefetch limit, take every message, close the channel;
- ``consume-some``: consume with prefetch 5, take 0..4, close the channel;
- ``nack-some``: the same, then ``basic.nack(multiple, requeue)`` before closing (pika's
  ``BlockingChannel.close`` also nacks what it received but did not yet hand over).

Then ``get-all`` is repeated 30 times on a fresh queue of 20: the count must stay 20 (a
broker that counts each give-back against a delivery limit would drop messages: RabbitMQ
4.0 gives quorum queues a default limit of 20).

``--rabbitmq-4.0`` runs it on a private RabbitMQ 4.0.5 node (tests/rabbit.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.adapters.blocking_connection

Channel = pika.adapters.blocking_connection.BlockingChannel

KINDS: dict[str, dict[str, Any]] = {
    "classic": {"x-queue-type": "classic"},
    "quorum": {"x-queue-type": "quorum"},
    "quorum-limit": {"x-queue-type": "quorum", "x-delivery-limit": 1000},
}


def _publish(channel: Channel, queue: str, ids: range) -> None:
    for i in ids:
        channel.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))


def _take(channel: Channel, queue: str, count: int, prefetch: int) -> list[int]:
    channel.basic_qos(prefetch_count=prefetch)
    got: list[int] = []
    for _ in range(count * 10 + 10):  # bounded: one 0.5 s timeout per missing message at most
        method, _props, body = next(channel.consume(queue, inactivity_timeout=0.5))
        if method is None:
            break
        got.append(int(body))
        if len(got) >= count:
            break
    return got


def _get(channel: Channel, queue: str, most: int) -> list[int]:
    held = []
    for _ in range(most):
        method, _p, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        held.append(int(body))
    return held


def _drain(connection: pika.BlockingConnection, queue: str) -> tuple[list[int], list[Any]]:
    channel = connection.channel()
    order, counts = [], []
    for _ in range(100_000):
        method, props, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            break
        order.append(int(body))
        counts.append((props.headers or {}).get("x-delivery-count"))
    channel.close()
    return order, counts


def _give_back(
    way: str,
) -> Callable[[pika.BlockingConnection, Channel, str], list[int]]:
    def consume_all(conn: pika.BlockingConnection, ch: Channel, q: str) -> list[int]:
        held = _take(ch, q, 20, 0)
        _publish(conn.channel(), q, range(20, 25))
        held += _take(ch, q, 5, 0)
        ch.close()
        return held

    def get_all(conn: pika.BlockingConnection, ch: Channel, q: str) -> list[int]:
        held = _get(ch, q, 20)
        _publish(conn.channel(), q, range(20, 25))
        held += _get(ch, q, 100)
        ch.close()
        return held

    def some(conn: pika.BlockingConnection, ch: Channel, q: str) -> list[int]:
        held = _take(ch, q, 5, 5)
        _publish(conn.channel(), q, range(20, 25))
        time.sleep(0.3)
        if way == "nack-some":
            ch.basic_nack(multiple=True, requeue=True, delivery_tag=0)
            time.sleep(0.3)
        ch.close()
        return held

    def get_some(conn: pika.BlockingConnection, ch: Channel, q: str) -> list[int]:
        held = _get(ch, q, 5)
        _publish(conn.channel(), q, range(20, 25))
        time.sleep(0.3)
        ch.close()
        return held

    ways = {"get-all": get_all, "get-some": get_some, "consume-all": consume_all}
    return ways.get(way, some)


@contextlib.contextmanager
def _queue(url: str, kind: str, total: int) -> Iterator[tuple[pika.BlockingConnection, str]]:
    """A fresh queue of ``kind`` holding ``total`` confirmed messages 0..total-1."""
    queue = f"partq.bench.peek.{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        setup = connection.channel()
        setup.confirm_delivery()
        setup.queue_declare(queue, durable=True, arguments=KINDS[kind])
        _publish(setup, queue, range(total))
        yield connection, queue
    finally:
        connection.channel().queue_delete(queue)
        connection.close()


def one(url: str, kind: str, way: str) -> dict[str, Any]:
    with _queue(url, kind, 20) as (connection, queue):
        held = _give_back(way)(connection, connection.channel(), queue)
        time.sleep(0.3)
        order, counts = _drain(connection, queue)
        return {"kind": kind, "way": way, "held": held, "order": order, "counts": counts,
                "in_order": order == sorted(order), "lost": sorted(set(range(25)) - set(order))}  # fmt: skip


def repeated(url: str, kind: str, times: int = 30) -> dict[str, Any]:
    with _queue(url, kind, 20) as (connection, queue):
        for _ in range(times):
            channel = connection.channel()
            _get(channel, queue, 100)
            channel.close()
        time.sleep(0.3)
        order, counts = _drain(connection, queue)
        return {"kind": kind, "way": f"get-all x{times}", "order": order, "counts": counts,
                "in_order": order == sorted(order), "lost": sorted(set(range(20)) - set(order))}  # fmt: skip


def window(url: str, kind: str, total: int, held: int) -> dict[str, Any]:
    """``total`` messages, a consumer with prefetch ``held`` takes ``held`` of them (it can
    be given no more), 5 arrive, the channel closes."""
    with _queue(url, kind, total) as (connection, queue):
        channel = connection.channel()
        got = _take(channel, queue, held, held)
        _publish(connection.channel(), queue, range(total, total + 5))
        channel.close()
        time.sleep(0.3)
        order, _counts = _drain(connection, queue)
        return {"kind": kind, "way": f"window {len(got)} of {total}", "in_order": order == sorted(order),
                "lost": sorted(set(range(total + 5)) - set(order)), "first": order[:12]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--rabbitmq-4.0", dest="rabbit_40", action="store_true")
    args = ap.parse_args(argv)
    node = None
    if args.rabbit_40:
        from tests.rabbit import tree_rabbit

        node = tree_rabbit().start()
        args.url = node.url
    try:
        with pika.BlockingConnection(pika.URLParameters(args.url)) as connection:
            print("RabbitMQ", connection._impl.server_properties["version"])
        for kind in KINDS:
            for way in ("get-all", "get-some", "consume-all", "consume-some", "nack-some"):
                row = one(args.url, kind, way)
                print(json.dumps({k: row[k] for k in ("kind", "way", "in_order", "lost")}),
                      "order", row["order"], "counts", row["counts"])  # fmt: skip
            for total, held in ((3000, 2000), (3000, 3000)):
                print(json.dumps(window(args.url, kind, total, held)))
            row = repeated(args.url, kind)
            print(json.dumps({k: row[k] for k in ("kind", "way", "in_order", "lost")}),
                  "counts", row["counts"][:3])  # fmt: skip
    finally:
        if node is not None:
            node.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
