"""partq.cli.web: a failure behind an endpoint is a one-line answer, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from partq.kernel.errors import BrokerUnavailable
from tests.unit.http_server import get


def failing(error: Exception) -> Callable[[], Any]:
    def fail() -> Any:
        raise error

    return fail


def test_a_partq_error_is_a_503_with_one_line(
    server: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    reason = "cannot reach RabbitMQ at amqp://guest:***@h:5672/: is it running?\n(detail)"
    base = server(page=failing(BrokerUnavailable(reason)), ready=failing(BrokerUnavailable("x")))
    with caplog.at_level(logging.INFO, logger="partq.http"):
        answers = [get(base + "/") for _ in range(5)]
    for status, body, headers in answers:
        assert status == 503
        assert body == "unavailable: " + " ".join(reason.split()) + "\n"
        assert "Traceback" not in body
        assert headers.get("Refresh") == "2"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # once, not per GET
    assert not warnings[0].exc_info  # a PartqError: no traceback in the log either
    status, body, _ = get(base + "/readyz")
    assert (status, body) == (503, "unavailable: x\n")


def test_an_unexpected_error_is_a_500_with_one_line(server: Callable[..., str]) -> None:
    base = server(page=failing(RuntimeError("boom\nsecond line")))
    status, body, _ = get(base + "/")
    assert (status, body) == (500, "internal error: RuntimeError: boom second line\n")


def test_metrics_are_served_when_preparing_them_fails(server: Callable[..., str]) -> None:
    base = server(before_metrics=failing(BrokerUnavailable("broker down")))
    status, body, _ = get(base + "/metrics")
    assert status == 200
    assert "# HELP" in body
