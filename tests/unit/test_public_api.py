"""partq's public API: ``__all__`` names exactly the names it imports on first use, and each
one resolves (``import partq`` itself imports none of them)."""

from __future__ import annotations

import partq


def test_all_is_every_lazily_imported_name_and_the_version() -> None:
    assert sorted(partq.__all__) == sorted([*partq._HOMES, "__version__"])


def test_each_public_name_resolves() -> None:
    for name in partq.__all__:
        assert getattr(partq, name) is not None, name
    assert partq.Producer.__module__ == "partq.producer.publisher"
