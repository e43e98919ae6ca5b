"""The soak's results as a plain-text table (Markdown-compatible, for docs/benchmarks.md)."""

from __future__ import annotations

import math
from typing import Any

from partq.coordinator.leader.policy import standby_mode

from .broker_memory import table as broker_table
from .verdict import IDLE_LIMIT

__all__ = ["table"]


def _s(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def table(results: dict[str, Any]) -> str:
    v = results["verdict"]
    stream = results["stream"]
    faults = ", ".join(f"{k} {n}" for k, n in v["faults"].items()) or "none"
    dup_total = sum(v["duplicates"].values())
    dups = ", ".join(f"{k} {n}" for k, n in v["duplicates"].items()) or "-"
    lines = [
        f"partq chaos soak: seed {results['seed']}, {results['duration_s']:.0f} s of faults, "
        f"{stream['partitions']} {stream['queue_type']} partitions, {results['keys']} keys at "
        f"{results['rate']:.0f} msg/s, standby {_standby(results['standby'])}, "
        f"balance {results['balance']}, handoff {results.get('handoff', 'drain')}",
        f"RabbitMQ {results['rabbitmq']}; started {results['started']}; load average "
        f"{results['load_before']} before, {results['load_after']} after",
        f"command: {results['command']}",
        f"rabbitmq.conf added: {', '.join(results.get('rabbit_conf', [])) or 'nothing'}; "
        f"Ra WAL max (raft.wal_max_size_bytes) {results.get('wal_max_size_bytes')} bytes",
        "",
        "| check | result |",
        "|---|---|",
        f"| faults fired | {faults} |",
        f"| confirmed / handled / redelivered | {v['confirmed']} / {v['handled']} / "
        f"{v['redelivered']} |",
        f"| publishes failed (nacked or unconfirmed, reported to the producer) | "
        f"{results['publish_failures']} |",
        f"| **lost** (confirmed, never handled) | **{v['lost']}** |",
        f"| duplicates (extra handlings), by the latest fault before them | {dup_total}: {dups} |",
        f"| order violations, raw | {v['order_raw']} |",
        f"| **order violations not explained by a crash's window** | "
        f"**{v['order_unexplained']}** |",
        f"| overlaps (two processes on one partition at once), raw | {v['overlaps_raw']} |",
        f"| **overlaps not explained by a handler call a process was frozen inside** (RabbitMQ "
        f"noticed the freeze first: docs/guarantees.md, Limits) | **{v['overlaps']}** |",
        f"| **fencing tokens that did not fence** (a later owner's not greater) | "
        f"**{v.get('fencing', 0)}** |",
        f"| **stalls: a partition idle over {results.get('idle_limit', IDLE_LIMIT):.0f} s while a "
        f"message waited in it** (longest of the run) | **{v.get('stalls', 0)}** "
        f"({v.get('longest_stall', 0.0):.1f} s) |",
        "",
        "| pause after a fault (longest gap per partition, s) | n | p50 | p99 | max |",
        "|---|---|---|---|---|",
        *(
            f"| {kind} | {p['n']} | {_s(p['p50'])} | {_s(p['p99'])} | {_s(p['max'])} |"
            for kind, p in v["pauses"].items()
        ),
        "",
        "| process (pid) | RSS first MiB | max | last |",
        "|---|---|---|---|",
        *(
            f"| {name} | {m['first']:.0f} | {m['max']:.0f} | {m['last']:.0f} |"
            for name, m in v["memory"].items()
        ),
        "",
        *(broker_table(results["broker_memory"]) if results.get("broker_memory") else []),
        "",
    ]
    for title, key in (
        ("lost", "lost_examples"),
        ("order", "order_examples"),
        ("overlap", "overlap_examples"),
        ("fencing", "fencing_examples"),
        ("stall", "stall_examples"),
    ):
        lines += [f"{title}: {example}" for example in v.get(key, [])]
    lines.append(f"verdict: {'PASS' if v['passed'] else 'FAIL'}")
    return "\n".join(lines)


def _standby(recorded: bool | str) -> str:
    """on, off or auto (older results recorded the flag)."""
    return standby_mode(recorded) if isinstance(recorded, bool) else recorded
