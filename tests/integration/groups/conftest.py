"""The invariant suite runs on both RabbitMQ versions: the machine's (3.10.8 here) and
4.0.5 from the trixie tree (tests/rabbit.py: tree_rabbit; docs/versions.md)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import AMQP_URL


@pytest.fixture(scope="session", params=["machine", "4.0.5"])
def rabbitmq(request: pytest.FixtureRequest) -> str:
    if request.param == "4.0.5":
        return str(request.getfixturevalue("rabbitmq_40"))
    if os.environ.get("PARTQ_TEST_RABBITMQ") == "4.0.5":
        pytest.skip("the whole run is on 4.0.5 (PARTQ_TEST_RABBITMQ)")
    return AMQP_URL
