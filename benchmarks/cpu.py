"""How busy the machine's cores were: two readings of ``/proc/stat``.

A benchmark's latencies mean something of the product only on a machine with cores to
spare: where the benchmark's own processes (the broker, the consumers, the load) keep
every core busy, a thread waits for a core, and a Python thread for the GIL its holder
keeps while it waits for one. :func:`busy_share` says which case a run was.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["busy_share", "jiffies"]


def jiffies(stat: Path = Path("/proc/stat")) -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot: busy is everything but idle and iowait."""
    with stat.open() as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    idle = cpu[3] + cpu[4]
    return sum(cpu) - idle, sum(cpu)


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of all cores that was busy between two :func:`jiffies` readings."""
    return (after[0] - before[0]) / max(1, after[1] - before[1])
