"""A keyed producer as an OS process (for a test to SIGSTOP): ``python -m
tests.integration.groups.keyed_producer STREAM OUT STOP``.

An SDK ``Producer`` that reads the spec from etcd (``PARTQ_ETCD_ENDPOINTS``) and follows
it publishes ``{"seq": n}`` for 40 keys, round after round at about 400 msg/s, until the
file STOP exists; each confirmed message is a line ``key seq`` in OUT, and the last line
is ``rerouted N``: how many messages a cut returned and it republished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

from partq.producer import Producer, Receipt


def main(stream: str, out: str, stop: str) -> None:
    keys = [f"key-{i:03d}" for i in range(40)]
    with Producer(stream, name="keyed-producer") as producer, open(out, "a") as done:

        def confirmed(key: str, seq: int) -> Callable[[Future[Receipt]], None]:
            def note(future: Future[Receipt]) -> None:
                if future.exception() is None:
                    done.write(f"{key} {seq}\n")

            return note

        seq = 0
        while not os.path.exists(stop) and seq < 100_000:
            batch = [(k, json.dumps({"key": k, "seq": seq}), None, f"{k}:{seq}") for k in keys]
            for key, future in zip(keys, producer.publish_many(batch), strict=True):
                future.add_done_callback(confirmed(key, seq))
            seq += 1
            time.sleep(0.1)
        producer.flush(60)
        done.write(f"rerouted {producer.rerouted}\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
