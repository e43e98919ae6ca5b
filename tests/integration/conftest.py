"""Fixtures of the integration tests that run partq processes on a fresh stream."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamSpec
from partq.producer.contract import OnFailure, QueueType
from partq.producer.registry import Registry

from partq.kernel.settings import Settings

from .groups.harness import Fleet


@pytest.fixture
def quorum_fleet(
    registry: Registry, settings: Settings, rabbitmq: str, stream_name: str, tmp_path: Path
) -> Iterator[Callable[..., Fleet]]:
    """``quorum_fleet(P[, on_failure[, queue_type]])``: a stream of P partitions (quorum unless
    told) and a Fleet on it, both removed (the processes ended by PID) after the test."""
    fleets: list[Fleet] = []

    def make(
        partitions: int, on_failure: OnFailure = "dead-letter", queue_type: QueueType = "quorum"
    ) -> Fleet:
        spec = StreamSpec(stream_name, partitions, queue_type, on_failure=on_failure)
        admin.create_stream(registry, rabbitmq, spec)
        fleet = Fleet(
            stream_name, tmp_path, settings.etcd_endpoints, rabbitmq, tmp_path / "rec.jsonl"
        )
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()
    if fleets:
        with contextlib.suppress(Exception):
            admin.delete(registry, rabbitmq, stream_name)
