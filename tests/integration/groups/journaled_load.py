"""A keyed load in a process of its own, to be killed -9: ``python -m
tests.integration.groups.journaled_load STREAM JOURNAL``.

An SDK producer that follows the stream's spec (etcd and RabbitMQ from the ``PARTQ_*``
environment, as a fleet's processes get them) publishes 20 keys ``proc-key-NNN`` at 200
msg/s and appends each confirm to JOURNAL as a line ``KEY SEQ``: what the broker
confirmed before a kill is what it wrote whole (:func:`confirmed`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from partq.producer import Producer

from tests.integration.groups.test_resize_clients import KeyedLoad

PREFIX = "proc-"


def confirmed(journal: Path) -> set[tuple[str, int]]:
    """The (key, seq) pairs of the journal's whole lines (a kill may cut the last)."""
    lines = journal.read_text().split("\n")[:-1] if journal.exists() else []
    return {(key, int(seq)) for key, seq in (line.split(" ") for line in lines)}


def main(stream: str, journal: str) -> None:
    producer = Producer(stream, name="journaled-load")
    with open(journal, "a", buffering=1) as out:
        KeyedLoad(producer, keys=20, rate=200.0, prefix=PREFIX, journal=out).run()
    producer.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
