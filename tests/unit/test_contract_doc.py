"""docs/contract.md restates the contract for other languages: it must agree with the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

from partq.producer import contract

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "contract.md").read_text()
VECTORS = json.loads((ROOT / "tests" / "data" / "partition-vectors.json").read_text())


def _doc_vectors() -> list[list[str]]:
    table = DOC.split("| key | murmur3_x86_32 |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_documented_vectors_are_the_golden_file() -> None:
    rows = _doc_vectors()
    assert len(rows) == len(VECTORS["vectors"])
    for row, vector in zip(rows, VECTORS["vectors"], strict=True):
        key = bytes.fromhex(vector["key_hex"]) if "key_hex" in vector else vector["key"]
        assert int(row[1]) == vector["murmur3_x86_32"], row
        for cell, partitions in zip(row[2:], (3, 16, 271, 1024), strict=True):
            assert int(cell) == vector["partition"][str(partitions)], (row, partitions)
            assert int(cell) == contract.partition_for(key, partitions), (row, partitions)


def test_the_documented_names_and_headers_are_the_codes() -> None:
    for header in (
        contract.HEADER_KEY,
        contract.HEADER_KEY_B64,
        contract.HEADER_PARTITION,
        contract.HEADER_PUBLISHED_MS,
    ):
        assert f"| `{header}` |" in DOC, header
    assert f"`{contract.exchange_name('NAME')}`" in DOC
    assert contract.queue_name("orders", 7) in DOC
    assert f"`{contract.dead_letter_queue('NAME')}`" in DOC
    documented = re.search(r"the regex `([^`]+)` selects", DOC)
    assert documented is not None
    assert documented.group(1) == contract.queue_pattern("NAME")
