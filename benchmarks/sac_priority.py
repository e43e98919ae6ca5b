# ruff: noqa: E501  (report lines)
"""Does a single-active-consumer queue switch to a waiting consumer of higher priority?

    .venv/bin/python -m benchmarks.sac_priority                  # a private node of the machine's RabbitMQ
    .venv/bin/python -m benchmarks.sac_priority --rabbitmq 4.0.5 # a private 4.0.5 node (.ci/rabbitmq-4.0)

RabbitMQ 4.0's quorum queues ("SAC consumer priority", rabbitmq-server 203b671) activate a
waiting consumer whose ``x-priority`` is above the active one's, but only once the active
one has settled every delivery it holds; meanwhile it is sent nothing more. That is
partq's planned drain done by the broker. This probes it with raw pika, per queue type
(declared by ``partq.producer.topology.declare_stream``, as partq declares a partition queue:
single active consumer; quorum with its delivery limit) and per pair of priorities, on a
fresh one-partition stream:

1. ``--window`` messages are published (body: their number), confirmed;
2. consumer A (own connection, prefetch twice the window, ``x-priority`` a) receives all of them
   and acks none;
3. consumer B (own connection, same prefetch, ``x-priority`` b) subscribes;
4. ``--window`` more messages are published; both are pumped for ``--settle`` seconds:
   what A got of them (*A got more*: it was left active) and what B got (*B early*: served
   while A held unsettled messages, the reorder partq must never allow);
5. A acks all its messages but the last; pumped again (*B early* counts this too);
6. A acks its last; the time until B's first delivery is the *switch* (none within
   ``--timeout``: B never became active); then everything left is taken by whichever
   consumer the broker serves (A acks what it gets too) and B's order is checked.

Not a test: it asserts nothing. Every wait is bounded; private nodes are stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from partq.producer.contract import StreamSpec
from partq.producer.topology import declare_stream, delete_stream

from benchmarks.fence_order import heading

PAIRS = ((1, 2), (2, 1), (None, 1))  # (A's x-priority, B's); None: no argument


@dataclass
class _Consumer:
    """One consumer on its own connection: what it got, in order; A holds, B acks."""

    connection: pika.BlockingConnection
    ack: bool
    got: list[int] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)
    first_at: float | None = None
    cancelled: bool = False

    def consume(self, queue: str, prefetch: int, priority: int | None) -> Any:
        channel = self.connection.channel()
        channel.basic_qos(prefetch_count=prefetch)

        def on_message(ch: Any, method: Any, _p: Any, body: bytes) -> None:
            if self.first_at is None:
                self.first_at = time.monotonic()
            self.got.append(int(body))
            if self.ack:
                ch.basic_ack(method.delivery_tag)
            else:
                self.tags.append(method.delivery_tag)

        def on_cancel(_frame: Any) -> None:
            self.cancelled = True  # the broker cancelled us (consumer_cancel_notify)

        channel.add_on_cancel_callback(on_cancel)
        arguments = None if priority is None else {"x-priority": priority}
        channel.basic_consume(queue, on_message, arguments=arguments)
        return channel


@dataclass(frozen=True)
class Outcome:
    queue_type: str
    a_priority: int | None
    b_priority: int | None
    a_more: int  # of the second batch, sent to A after B subscribed
    b_early: int  # sent to B while A held unsettled messages
    switch_ms: float | None  # A's last ack -> B's first delivery; None: B never active
    b_in_order: bool
    complete: bool  # A's and B's together: every message
    cancelled: bool  # A got a basic.cancel from the broker


def pump(consumers: list[_Consumer], seconds: float, done: Any = None) -> None:
    """Serve every connection for up to ``seconds`` (until ``done()``, if given)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (done is not None and done()):
        for c in consumers:
            c.connection.process_data_events(time_limit=0.005)


def probe(
    url: str,
    queue_type: str,
    priorities: tuple[int | None, int | None],
    window: int,
    settle: float,
    timeout: float,
) -> Outcome:
    spec = StreamSpec(f"sac-priority-{uuid.uuid4().hex[:8]}", 1, queue_type)  # type: ignore[arg-type]
    queue = spec.queue(0)
    params = pika.URLParameters(url)
    admin = pika.BlockingConnection(params)
    declare_stream(admin, spec)
    a = b = None
    try:
        publisher = admin.channel()
        publisher.confirm_delivery()

        def publish(numbers: range) -> None:
            for n in numbers:
                publisher.basic_publish(
                    "", queue, str(n).encode(), pika.BasicProperties(delivery_mode=2)
                )

        publish(range(window))
        a = _Consumer(pika.BlockingConnection(params), ack=False)
        a_channel = a.consume(queue, 2 * window, priorities[0])
        pump([a], timeout, lambda: len(a.got) >= window)
        b = _Consumer(pika.BlockingConnection(params), ack=True)
        b.consume(queue, 2 * window, priorities[1])
        pump([a, b], settle)
        publish(range(window, 2 * window))
        pump([a, b], settle)
        a_more = len(a.got) - window
        for tag in a.tags[:-1]:
            a_channel.basic_ack(tag)
        pump([a, b], settle)
        b_early = len(b.got)
        a.ack = True  # from here A acks what it is still sent
        last, a.tags = a.tags[-1], []
        acked_at = time.monotonic()
        a_channel.basic_ack(last)
        pump([a, b], timeout, lambda: b.first_at is not None)
        switch = None if b.first_at is None else (b.first_at - acked_at) * 1000
        total = 2 * window
        pump([a, b], timeout, lambda: len(a.got) + len(b.got) >= total)
        return Outcome(
            queue_type, *priorities, a_more, b_early, switch,
            b.got == sorted(b.got), sorted(a.got + b.got) == list(range(total)), a.cancelled,
        )  # fmt: skip
    finally:
        for c in (a, b):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.connection.close()
        with contextlib.suppress(Exception):
            delete_stream(admin, spec)
        with contextlib.suppress(Exception):
            admin.close()


@contextlib.contextmanager
def broker(version: str) -> Iterator[tuple[str, str]]:
    """A private node (the machine's RabbitMQ or 4.0.5): its URL and version string."""
    from tests.rabbit import MACHINE, TREE_40, PrivateRabbit  # only benchmarks start nodes

    with tempfile.TemporaryDirectory(prefix="sac-priority-") as directory:
        install = TREE_40 if version == "4.0.5" else MACHINE
        node = PrivateRabbit(Path(directory), name=f"sacprio-{os.getpid()}", install=install)
        node.start()
        try:
            with pika.BlockingConnection(pika.URLParameters(node.url)) as connection:
                server = connection._impl.server_properties["version"]
            yield node.url, server.decode() if isinstance(server, bytes) else str(server)
        finally:
            node.stop()


def _cell(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rabbitmq", choices=("machine", "4.0.5"), default="machine")
    parser.add_argument("--window", type=int, default=20, help="messages A holds unsettled")
    parser.add_argument("--runs", type=int, default=3, help="runs of each case")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds pumped per step")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    with broker(args.rabbitmq) as (url, version):
        print(heading(f"{version} (private node)", args.window))
        print(
            "| RabbitMQ | queue | x-priority A → B | B became active | A sent more after B came | B served while A held | switch after A's last ack (per run) | B in order, all delivered | A cancelled by the broker |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for queue_type in ("quorum", "classic"):
            for pair in PAIRS:
                runs = [
                    probe(url, queue_type, pair, args.window, args.settle, args.timeout)
                    for _ in range(args.runs)
                ]
                active = sum(1 for o in runs if o.switch_ms is not None)
                names = " → ".join("none" if p is None else str(p) for p in pair)
                print(
                    f"| {version} | {queue_type} | {names} | {active}/{len(runs)} "
                    f"| {', '.join(str(o.a_more) for o in runs)} "
                    f"| {', '.join(str(o.b_early) for o in runs)} "
                    f"| {', '.join(_cell(o.switch_ms) for o in runs)} "
                    f"| {sum(1 for o in runs if o.b_in_order and o.complete)}/{len(runs)} "
                    f"| {sum(1 for o in runs if o.cancelled)}/{len(runs)} |"
                )


if __name__ == "__main__":
    main()
