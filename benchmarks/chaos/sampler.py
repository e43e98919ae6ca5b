"""Resident memory of every process the soak runs, read from ``/proc`` every few seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .verdict import Sample

__all__ = ["Sampler", "rss_kib"]


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB, or None if it is gone (or a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Sampler(threading.Thread):
    """Every ``interval`` s, one :class:`Sample` per (label, pid) ``processes()`` names,
    until :meth:`stop`. ``processes`` runs on this thread: it must only read."""

    def __init__(
        self, processes: Callable[[], Iterable[tuple[str, int]]], interval: float = 5.0
    ) -> None:
        super().__init__(name="chaos-sampler", daemon=True)
        self.processes = processes
        self.interval = interval
        self.samples: list[Sample] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            try:
                found = list(self.processes())
            except Exception:  # a process list caught half-changed: try again next time
                found = []
            for label, pid in found:
                kib = rss_kib(pid)
                if kib is not None:
                    self.samples.append(Sample(now, label, pid, kib))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(self.interval + 5)
