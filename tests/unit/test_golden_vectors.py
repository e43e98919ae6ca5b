"""The golden hash vectors are pinned: changing them changes the public wire contract."""

from __future__ import annotations

import hashlib
from pathlib import Path

VECTORS = Path(__file__).resolve().parents[1] / "data" / "partition-vectors.json"

# Every producer and consumer, in any language, must put a key in the partition these vectors
# name. Editing the file is a change of the contract: update this hash only on purpose, in the
# same commit, and say so in its message.
VECTORS_SHA256 = "2607f3bb7975ace869b539210b371868ef931a847dbcbe9e53a5d460f83feff7"


def test_golden_vectors_are_the_pinned_file() -> None:
    digest = hashlib.sha256(VECTORS.read_bytes()).hexdigest()
    assert digest == VECTORS_SHA256, (
        f"{VECTORS} changed (sha256 {digest}): that changes partq's wire contract; "
        f"if that is intended, update VECTORS_SHA256 in the same commit"
    )
