"""What a consumer's config accepts: ``partq.run``'s keywords (issue 43, item 16) and the
bound of ``--concurrency`` (item 11). Nothing here connects to a server."""

from __future__ import annotations

import logging

import pytest
from partq.consumers.control.config import ConsumerConfig
from partq.consumers.handling.message import Message

import partq
from partq.kernel.errors import UsageError
from partq.kernel.settings import Settings

# Nothing listens there: a run that got as far as connecting would fail on it, with exit 1.
UNREACHABLE = Settings(etcd_endpoints="http://127.0.0.1:9")


def _handle(message: Message) -> None:
    pass


def test_an_unknown_keyword_of_run_is_a_usage_error_naming_the_accepted_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # When partq.run is given a keyword that is not a consumer option (an HTTP port: the CLI's)
    with caplog.at_level(logging.ERROR):
        code = partq.run(
            "orders", _handle, settings=UNREACHABLE, install_signal_handlers=False, http_port=0
        )
    # Then exit 2 before connecting, one line naming it and the keywords it takes (was a raw
    # TypeError from the config's constructor)
    assert code == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "http_port" in line and "prefetch" in line and "concurrency" in line, line
    assert "\n" not in line


def test_runs_docstring_lists_every_keyword_it_takes() -> None:
    for option in ConsumerConfig.options():
        assert f"``{option}``" in (partq.run.__doc__ or ""), option


def test_an_unknown_option_of_the_config_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"unknown consumer option 'bogus'.*prefetch"):
        ConsumerConfig.of("orders", UNREACHABLE, bogus=1)


@pytest.mark.parametrize("concurrency", [1025, 1_000_000])
def test_concurrency_above_its_bound_is_refused_in_one_line(concurrency: int) -> None:
    """Issue 43, item 11: one handler thread each; 1,000,000 started 19,000 threads in 40 s."""
    with pytest.raises(UsageError) as refused:
        ConsumerConfig.of("orders", UNREACHABLE, concurrency=concurrency)
    assert "between 1 and 1024" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="1024"):  # PARTQ_CONCURRENCY likewise
        Settings(concurrency=concurrency)


def test_concurrency_up_to_its_bound_is_taken() -> None:
    assert ConsumerConfig.of("orders", UNREACHABLE, concurrency=1024).concurrency == 1024
