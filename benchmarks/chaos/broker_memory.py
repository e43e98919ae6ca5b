"""RabbitMQ's own account of its memory, per node, over time: what RSS alone cannot say.

Every ``interval`` s one ``rabbitmqctl eval`` against a live node asks every running node
for ``rabbit_vm:memory()`` (the figures ``rabbitmq-diagnostics memory_breakdown`` prints:
``quorum_ets`` is the Ra log's in-memory tables, ``quorum_queue_procs`` the quorum queue
processes, ``connection_*`` the AMQP connections and channels, ``binary`` message bodies in
flight...), and the size of each node's Ra write-ahead log files on disk (a quorum queue's
entries stay in ``quorum_ets`` until the WAL they are in fills to
``raft.wal_max_size_bytes`` and is flushed to segment files). One CLI call per sample
(an Erlang VM start), so the interval is tens of seconds on a shared machine.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tests.cluster import RabbitCluster

__all__ = ["CATEGORIES", "BrokerSample", "BrokerSampler", "summary", "table"]

# Every node's rabbit_vm:memory(), node by node (a node that does not answer is left out).
ASK = (
    "[{N, rpc:call(N, rabbit_vm, memory, [], 20000)} || N <- [node() | nodes()], "
    'lists:prefix("partqc", atom_to_list(N))].'
)
# What the report shows, in this order (bytes in a sample, MiB in the table).
CATEGORIES = (
    "total",
    "quorum_ets",
    "quorum_queue_procs",
    "binary",
    "connection_readers",
    "connection_writers",
    "connection_channels",
    "connection_other",
    "other_ets",
    "other_proc",
    "metrics",
    "allocated_unused",
    "reserved_unallocated",
    "wal_on_disk",
)
_NODE = re.compile(r"\{'?(partqc\d+@[\w.-]+)'?,\s*\[(.*?)\]\}\s*(?=,\s*\{'?partqc|\]\s*$)", re.S)
_PAIR = re.compile(r"\{(\w+),\s*(\d+)\}")


@dataclass(frozen=True)
class BrokerSample:
    """One node's ``rabbit_vm:memory()`` (bytes by category) at wall-clock ``at``;
    ``total`` is RabbitMQ's own (its ``rss`` strategy), ``wal_on_disk`` the Ra WAL files."""

    at: float
    node: str
    bytes: dict[str, int]


def parse(out: str) -> dict[str, dict[str, int]]:
    """``rabbitmqctl eval``'s printed answer to :data:`ASK` -> node -> category -> bytes.
    ``total`` is a list of three (erlang, rss, allocated): RabbitMQ reports the rss one."""
    found: dict[str, dict[str, int]] = {}
    for node, body in _NODE.findall(out.strip()):
        pairs = {k: int(v) for k, v in _PAIR.findall(body)}
        pairs["total"] = pairs.pop("rss", pairs.get("total", 0))
        found[node] = pairs
    return found


def wal_bytes(rabbit: RabbitCluster, nodename: str) -> int:
    """Bytes of the node's Ra WAL files (``*.wal`` under its data directory)."""
    node = rabbit.node(nodename)
    return sum(p.stat().st_size for p in (node.directory / "mnesia").rglob("*.wal"))


class BrokerSampler(threading.Thread):
    """Every ``interval`` s, a :class:`BrokerSample` per running node, until :meth:`stop`."""

    def __init__(self, rabbit: RabbitCluster, interval: float = 20.0) -> None:
        super().__init__(name="chaos-broker-memory", daemon=True)
        self.rabbit = rabbit
        self.interval = interval
        self.samples: list[BrokerSample] = []
        self._halt = threading.Event()

    def _eval(self, expression: str) -> str:
        """``expression``'s value, printed by the first live node that answers ('' if none)."""
        for node in self.rabbit.nodes:
            if node.server is None or node.server.poll() is not None:
                continue
            try:
                return self.rabbit.ctl(node, "eval", expression, timeout=60)
            except (subprocess.SubprocessError, OSError):
                continue  # killed by the nemesis meanwhile: ask the next
        return ""

    def ask(self) -> dict[str, dict[str, int]]:
        return parse(self._eval(ASK))

    def wal_max_size_bytes(self) -> int | None:
        """The Ra WAL size in effect for quorum queues (``raft.wal_max_size_bytes``)."""
        out = self._eval("maps:get(wal_max_size_bytes, ra_system:fetch(quorum_queues)).")
        return int(out) if out.strip().isdigit() else None

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            for nodename, figures in sorted(self.ask().items()):
                with contextlib.suppress(OSError, StopIteration):  # a node just killed
                    figures["wal_on_disk"] = wal_bytes(self.rabbit, nodename)
                self.samples.append(BrokerSample(now, nodename, figures))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(self.interval + 70)


def summary(samples: Iterable[BrokerSample]) -> dict[str, dict[str, dict[str, float]]]:
    """node -> category -> first, max, last (MiB) and the number of samples."""
    series: dict[str, list[BrokerSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.at):
        series[s.node].append(s)
    found: dict[str, dict[str, dict[str, float]]] = {}
    for node, runs in sorted(series.items()):
        found[node] = {}
        for category in CATEGORIES:
            mib = [s.bytes.get(category, 0) / 2**20 for s in runs]
            found[node][category] = {
                "first": mib[0], "max": max(mib), "last": mib[-1], "samples": len(mib),
            }  # fmt: skip
    return found


def table(summarized: dict[str, Any]) -> list[str]:
    """One Markdown row per node and category: first → max → last MiB."""
    lines = [
        "| RabbitMQ node: category (rabbit_vm:memory) | first MiB | max | last |",
        "|---|---|---|---|",
    ]
    for node, categories in summarized.items():
        for category, m in categories.items():
            lines.append(
                f"| {node}: {category} | {m['first']:.0f} | {m['max']:.0f} | {m['last']:.0f} |"
            )
    return lines
