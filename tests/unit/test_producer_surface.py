"""The producer package's public surface: ``__all__`` names exactly what it exports."""

from __future__ import annotations

import inspect

from partq import producer


def test_all_names_every_public_name_and_nothing_else() -> None:
    # Given the producer package's public names (its submodules aside)
    public = {
        name
        for name, value in vars(producer).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    # Then __all__ lists each once, and exactly those
    assert len(producer.__all__) == len(set(producer.__all__))
    assert set(producer.__all__) == public
    # And both producers are part of it
    assert {"Producer", "AsyncProducer", "Receipt"} <= public
