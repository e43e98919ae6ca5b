"""partq.kernel.logs: JSON lines off a terminal, text on one, bound context, no passwords."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from partq.kernel import logs
from partq.kernel.amqp import redact_url
from partq.kernel.errors import UsageError

log = logging.getLogger("partq.test")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Each test configures the root logger; put it back as pytest had it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = (*logs.QUIET_LIBRARIES, *logs.PIKA_TRANSPORT)
    libraries = {name: logging.getLogger(name).level for name in named}
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    for name, library_level in libraries.items():
        logging.getLogger(name).setLevel(library_level)


def records(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_off_a_terminal_each_record_is_a_json_line_with_the_bound_fields() -> None:
    # Given logs configured on a stream that is not a terminal
    out = io.StringIO()
    logs.configure("INFO", stream=out)

    # When records are logged inside and outside bound contexts
    log.info("starting")
    with logs.bind(stream="orders", member="consumer-0"):
        log.info("joined")
        with logs.bind(partition=7):
            log.warning("draining %d messages", 3)
        log.info("left")

    # Then each line is JSON carrying exactly the fields bound at the time
    first, joined, draining, left = records(out)
    assert first["message"] == "starting"
    assert first["level"] == "INFO" and first["logger"] == "partq.test"
    assert not {"stream", "partition", "member"} & first.keys()
    assert (joined["stream"], joined["member"]) == ("orders", "consumer-0")
    assert "partition" not in joined
    assert draining["message"] == "draining 3 messages"
    assert (draining["stream"], draining["partition"], draining["member"]) == (
        "orders",
        7,
        "consumer-0",
    )
    assert "partition" not in left and left["stream"] == "orders"
    assert draining["time"].endswith("+00:00")


def test_an_exception_is_one_json_field() -> None:
    out = io.StringIO()
    logs.configure("INFO", stream=out)

    try:
        raise RuntimeError("handler failed")
    except RuntimeError:
        with logs.bind(stream="orders", partition=2):
            log.exception("giving up")

    (record,) = records(out)
    assert record["level"] == "ERROR"
    assert "RuntimeError: handler failed" in record["exception"]
    assert record["partition"] == 2


def test_a_field_given_with_extra_wins_over_the_bound_one() -> None:
    out = io.StringIO()
    logs.configure("INFO", stream=out)

    with logs.bind(stream="orders", partition=1):
        log.info("moved", extra={"partition": 9})

    assert records(out)[0]["partition"] == 9


def test_a_new_thread_does_not_inherit_the_bound_fields() -> None:
    # contextvars: a thread starts with an empty context unless it is handed one
    out = io.StringIO()
    logs.configure("INFO", stream=out)

    with logs.bind(member="consumer-0"):
        worker = threading.Thread(target=log.info, args=("from a thread",))
        worker.start()
        worker.join()
        assert logs.bound() == {"member": "consumer-0"}

    (record,) = records(out)
    assert "member" not in record
    assert logs.bound() == {}


def test_on_a_terminal_records_are_readable_text() -> None:
    # Given logs configured on a terminal
    out = Terminal()
    logs.configure("INFO", stream=out)

    # When a record is logged with and without context
    log.info("plain")
    with logs.bind(stream="orders", partition=3, member="consumer-1"):
        log.info("claimed")

    # Then the lines are text, with the context in brackets
    plain, claimed = out.getvalue().splitlines()
    assert plain.endswith("INFO  partq.test plain")
    assert claimed.endswith(
        "INFO  partq.test [stream=orders partition=3 member=consumer-1] claimed"
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(claimed)


@pytest.mark.parametrize(
    ("stream", "json_flag", "expect_json"),
    [(Terminal, True, True), (io.StringIO, False, False)],
    ids=["json-forced-on-a-terminal", "text-forced-off-a-terminal"],
)
def test_the_json_flag_overrides_the_terminal_check(
    stream: type[io.StringIO], json_flag: bool, expect_json: bool
) -> None:
    out = stream()
    logs.configure("INFO", json=json_flag, stream=out)

    log.info("hello")

    line = out.getvalue().strip()
    assert line.startswith("{") is expect_json


def test_a_url_logged_through_redact_url_shows_no_password() -> None:
    out = io.StringIO()
    logs.configure("INFO", stream=out)
    url = "amqp://partq:s3cret-pw@rabbitmq:5672/%2F"

    log.info("connecting to %s", redact_url(url))

    (record,) = records(out)
    assert record["message"] == "connecting to amqp://partq:***@rabbitmq:5672/%2F"
    assert "s3cret-pw" not in out.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO, Terminal], ids=["json", "text"])
def test_a_password_in_a_url_is_redacted_even_if_the_caller_forgot(
    stream: type[io.StringIO],
) -> None:
    out = stream()
    logs.configure("INFO", stream=out)

    try:
        raise ConnectionError("cannot reach amqps://partq:s3cret-pw@rabbitmq:5671/prod")
    except ConnectionError:
        log.exception("broker down: %s", "amqp://partq:s3cret-pw@rabbitmq:5672/%2F")

    text = out.getvalue()
    assert "s3cret-pw" not in text
    assert "amqp://partq:***@rabbitmq:5672/%2F" in text
    assert "amqps://partq:***@rabbitmq:5671/prod" in text


def test_libraries_log_only_warnings_even_at_debug() -> None:
    # Given debug logging
    out = io.StringIO()
    logs.configure("DEBUG", stream=out)

    # When the libraries and partq log below and at WARNING
    for library in logs.QUIET_LIBRARIES:
        logging.getLogger(f"{library}.internals").info("chatter")
        logging.getLogger(library).warning("%s trouble", library)
    log.debug("partq detail")

    # Then only the libraries' warnings and partq's debug line are written
    messages = [record["message"] for record in records(out)]
    assert messages == [f"{library} trouble" for library in logs.QUIET_LIBRARIES] + ["partq detail"]


def test_pikas_transport_errors_are_left_to_partq() -> None:
    # Given logging at INFO
    out = io.StringIO()
    logs.configure("INFO", stream=out)
    # When pika's transport logs a stream's end at ERROR (as for each connection partq
    # aborts itself), and pika elsewhere logs an error
    for transport in logs.PIKA_TRANSPORT:
        logging.getLogger(transport).error("Socket EOF")
    logging.getLogger("pika.channel").error("channel trouble")
    # Then only the latter is written
    assert [record["message"] for record in records(out)] == ["channel trouble"]


def test_a_stricter_level_also_applies_to_the_libraries() -> None:
    out = io.StringIO()
    logs.configure("ERROR", stream=out)

    logging.getLogger("pika").warning("ignored")
    log.warning("ignored too")

    assert out.getvalue() == ""


def test_configuring_twice_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.configure("INFO", stream=first)
    logs.configure("INFO", stream=second)

    log.info("once")

    assert first.getvalue() == ""
    assert len(records(second)) == 1


def test_an_unknown_level_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown log level 'LOUD'"):
        logs.configure("LOUD")


def test_configure_if_unset_keeps_an_application_s_handler() -> None:
    root = logging.getLogger()
    pytests = list(root.handlers)
    for handler in pytests:
        root.removeHandler(handler)
    try:
        # Given a root logger with a handler of the application's
        theirs = logging.StreamHandler(io.StringIO())
        root.addHandler(theirs)
        # When partq's entry point asks for its logging / Then the application's stays alone
        assert logs.configure_if_unset("INFO") is False
        assert root.handlers == [theirs]
        # And with no handler at all, partq configures its own
        root.removeHandler(theirs)
        assert logs.configure_if_unset("INFO") is True
        assert [h.get_name() for h in root.handlers] == ["partq"]
    finally:
        for handler in pytests:
            root.addHandler(handler)


@pytest.mark.parametrize(
    ("flag", "formatter"), [("text", logs.TextFormatter), ("json", logs.JsonFormatter)]
)
def test_the_log_format_flag_picks_the_format(
    flag: str, formatter: type[logging.Formatter]
) -> None:
    from click.testing import CliRunner

    from partq.cli import cli

    # Given the CLI run with --log-format (its stderr is no terminal)
    result = CliRunner().invoke(cli, ["--log-format", flag, "stream", "--help"])
    assert result.exit_code == 0, result.output
    # Then partq's handler on the root logger formats as asked
    ours = [h for h in logging.getLogger().handlers if h.get_name() == logs.HANDLER_NAME]
    assert len(ours) == 1 and type(ours[0].formatter) is formatter


def test_an_unknown_log_format_is_a_usage_error() -> None:
    from click.testing import CliRunner

    from partq.cli import cli

    result = CliRunner().invoke(cli, ["--log-format", "xml", "stream", "--help"])
    assert result.exit_code == 2
    assert "'xml' is not one of 'text', 'json'" in result.output
