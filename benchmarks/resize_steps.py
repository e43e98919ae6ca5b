"""How long do a resize's operator steps take on an idle stream (issue 22)?

    .venv/bin/python -m benchmarks.resize_steps [--url amqp://guest:guest@127.0.0.1:5672/%2F]
        [--rounds 3] [--queue-type quorum]

For 12 -> 24 and 24 -> 16, each on a fresh stream (a private etcd, the given RabbitMQ):
the time from the start of the resize to its switch (record, declare, cut, one confirmed
fence per old queue, bind, the spec's compare-and-set: what ``partq stream resize``
does before it returns), then, once the benchmark has recorded every fence handled and
consumed the fences of the retired queues (as consumers would), the time to retire
(a shrink's queues deleted). Idle: no producer, no consumer, so this is the operator
side alone, not the issue's resize under load. Report the machine's load beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import pika
from partq.coordinator.leader.resize import Phase
from partq.coordinator.leader.resizer import Resizer
from partq.coordinator.ops import admin
from partq.producer.contract import QueueType, StreamSpec, queue_name
from partq.producer.registry import Registry
from partq.producer.topology import delete_stream

from partq.kernel import keys
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings


def _consume_one(url: str, queue: str) -> None:
    """Take the fence a retired queue holds (a quorum queue with single active consumer
    refuses ``basic.get``)."""
    with pika.BlockingConnection(pika.URLParameters(url)) as connection:
        channel = connection.channel()
        for method, _properties, _body in channel.consume(queue, inactivity_timeout=5):
            if method is not None:
                channel.basic_ack(method.delivery_tag)
            break
        channel.cancel()


def one(
    registry: Registry, url: str, old: int, new: int, queue_type: QueueType
) -> tuple[float, float]:
    """(seconds to the switch, seconds to retire once drained) of one resize."""
    name = f"bench-resize-{uuid.uuid4().hex[:8]}"
    admin.create_stream(registry, url, StreamSpec(name, old, queue_type))
    try:
        resizer = Resizer(registry, url, name, interval=0.02)
        began = time.monotonic()
        resizer.start(new)
        resizer.run(Phase.SWITCHED, 120)
        switched = time.monotonic() - began
        for p in range(old):
            registry.client.put(keys.drained(name, 0, p), "{}")
        for p in range(new, old):
            _consume_one(url, queue_name(name, p))
        began = time.monotonic()
        if resizer.run(Phase.RETIRED, 120).phase is not Phase.RETIRED:
            raise AssertionError("not retired")
        return switched, time.monotonic() - began
    finally:
        with pika.BlockingConnection(pika.URLParameters(url)) as connection:
            delete_stream(connection, StreamSpec(name, max(old, new), queue_type))
        registry.delete(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    args = parser.parse_args()
    with LocalEtcd() as etcd:
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoint))
        for old, new in ((12, 24), (24, 16)):
            times = [one(registry, args.url, old, new, args.queue_type) for _ in range(args.rounds)]
            to_switch = [round(s * 1000) for s, _ in times]
            to_retire = [round(r * 1000) for _, r in times]
            print(
                f"{old} -> {new} ({args.queue_type}): to the switch {to_switch} ms "
                f"(median {statistics.median(to_switch):.0f}), to retire once drained "
                f"{to_retire} ms (median {statistics.median(to_retire):.0f})"
            )
        registry.close()


if __name__ == "__main__":
    main()
