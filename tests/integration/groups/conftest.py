"""The invariant suite runs on both RabbitMQ versions: the machine's (3.10.8 here) and
4.0.5 from the trixie tree (tests/rabbit.py: tree_rabbit; docs/versions.md)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import AMQP_URL, EVERY_FAULT


@pytest.fixture(scope="session", params=["machine", "4.0.5"])
def rabbitmq(request: pytest.FixtureRequest) -> str:
    if request.param == "4.0.5":
        return str(request.getfixturevalue("rabbitmq_40"))
    if os.environ.get("PARTQ_TEST_RABBITMQ") == "4.0.5":
        pytest.skip("the whole run is on 4.0.5 (PARTQ_TEST_RABBITMQ)")
    return AMQP_URL


@pytest.fixture
def machine_version_in_ci(request: pytest.FixtureRequest) -> None:
    """A module that uses this runs on RabbitMQ 4.0.5 only on demand
    (``PARTQ_TEST_EVERY_FAULT=1``, or ``PARTQ_TEST_RABBITMQ=4.0.5`` for a whole run on
    4.0.5): CI's default run keeps within its 30 minutes with the machine's version alone
    for the resize's long tests, for the faults of the coordinator and etcd, which do not
    depend on the broker's version, and for joins and leaves with and without concurrency
    (on 4.0.5, CI moves partitions under load in ``test_priority_handoff``, without
    concurrency). The frozen owner and the kill -9 run on both in CI."""
    callspec = getattr(request.node, "callspec", None)
    on_40 = callspec is not None and callspec.params.get("rabbitmq") == "4.0.5"
    if on_40 and not os.environ.get(EVERY_FAULT):
        pytest.skip(f"on 4.0.5 on demand: {EVERY_FAULT}=1 (CI's time budget)")
