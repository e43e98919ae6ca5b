"""The handler records, read as they grow: each call parses only the lines added since."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["RecordReader"]

# What the checker reads of a record (examples.audit, benchmarks.chaos.verdict).
FIELDS = ("key", "seq", "partition", "pid", "start", "end", "redelivered", "published_ms")


class RecordReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.handled: set[tuple[str, int]] = set()
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """Every complete line so far (a line still being written waits for the next call)."""
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            complete = chunk.rfind(b"\n") + 1
            self._offset += complete
            for line in chunk[:complete].splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.records.append({k: r.get(k) for k in FIELDS})
                    self.handled.add((r["key"], r["seq"]))
        return self.records

    def covers(self, confirmed: Iterable[tuple[str, int]]) -> bool:
        self.read()
        return all(k in self.handled for k in confirmed)
