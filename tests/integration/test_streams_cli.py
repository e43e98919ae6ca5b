"""The ``partq`` command, run as a subprocess against a real etcd and RabbitMQ.

Exit codes: 0 ok, 2 usage or validation error, 1 runtime failure. Errors are one
line on stderr without a traceback, and no password ever shows.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamNotFound, StreamSpec, partition_for
from partq.producer.registry import Registry

from partq.kernel.local import LocalEtcd, free_port

pytestmark = [pytest.mark.integration]

PARTQ = str(Path(sys.executable).with_name("partq"))
SECRET = "s3cret-pw"

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def partq(etcd_server: LocalEtcd, rabbitmq: str) -> Run:
    """Run ``partq ARGS`` with PARTQ_ETCD_ENDPOINTS / PARTQ_AMQP_URL set (``env`` overrides)."""

    def run(
        *args: str, env: dict[str, str] | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
        environ["PARTQ_ETCD_ENDPOINTS"] = etcd_server.endpoint
        environ["PARTQ_AMQP_URL"] = rabbitmq
        environ.update(env or {})
        return subprocess.run(
            [PARTQ, *args],
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=environ,
            timeout=60,
            check=False,
        )

    return run


@pytest.fixture
def stream(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[str]:
    """This test's stream name; whatever the test created under it is deleted afterwards."""
    yield stream_name
    with contextlib.suppress(StreamNotFound):  # the test deleted it, or never created it
        admin.delete(registry, rabbitmq, stream_name)


@pytest.fixture
def created(registry: Registry, rabbitmq: str, stream: str) -> StreamSpec:
    """This test's stream, created with 8 quorum partitions."""
    spec = StreamSpec(stream, 8, "quorum")
    assert admin.create_stream(registry, rabbitmq, spec) is True
    return spec


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("partq: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def write_lines(path: Path, docs: list[object]) -> Path:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return path


def describe(partq: Run, stream: str) -> dict[str, object]:
    result = partq("stream", "describe", stream, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def queued(registry: Registry, rabbitmq: str, stream: str) -> int:
    """Messages in the stream's queues, asked in-process (quicker than a subprocess)."""
    queues = admin.describe(registry, rabbitmq, stream).queues
    return sum(q.messages or 0 for q in queues)


# -- stream create / describe / list / delete ----------------------------------------------


def test_create_is_idempotent_and_describe_shows_every_partition(partq: Run, stream: str) -> None:
    # Given a new stream name
    # When it is created twice with the same spec
    first = partq("stream", "create", stream, "--partitions", "8", "--queue-type", "classic")
    second = partq("stream", "create", stream, "-p", "8", "--queue-type", "classic")
    # Then both succeed, the second saying nothing changed
    assert first.returncode == 0, first.stderr
    assert f"stream {stream} created 8 partitions, classic queues, on failure park" in first.stdout
    assert second.returncode == 0, second.stderr
    assert "exists, unchanged" in second.stdout
    # And describe --json shows the spec and every partition's empty queue
    doc = describe(partq, stream)
    assert doc["partitions"] == 8
    assert doc["queue_type"] == "classic"
    queues = doc["queues"]
    assert isinstance(queues, list)
    assert [q["partition"] for q in queues] == list(range(8))
    assert all(q["messages"] == 0 and q["consumers"] == 0 for q in queues)
    # And list shows it
    listed = partq("stream", "list", "--json")
    assert listed.returncode == 0
    listed_spec = {"v": 1, "name": stream, "partitions": 8, "queue_type": "classic"}
    assert {**listed_spec, "on_failure": "park"} in json.loads(listed.stdout)


def test_create_with_another_partition_count_exits_2(partq: Run, created: StreamSpec) -> None:
    # Given a stream of 8 partitions
    # When it is created again with 12
    result = partq("stream", "create", created.name, "-p", "12")
    # Then partq exits 2 with one line naming both counts
    assert result.returncode == 2
    assert_one_line_error(result, "8 partitions", "not 12")
    assert result.stdout == ""


@pytest.mark.parametrize("name", ["Bad_Name", "a" * 101])
def test_invalid_stream_name_exits_2(partq: Run, name: str) -> None:
    # Given an invalid stream name
    # When a stream is created with it
    result = partq("stream", "create", name, "-p", "4")
    # Then partq exits 2 and explains the naming rule on one line
    assert result.returncode == 2
    assert_one_line_error(result, "invalid stream name", "[a-z0-9][a-z0-9_.-]*")


def test_unknown_stream_exits_1(partq: Run, stream: str) -> None:
    # Given a stream that was never created
    # When it is described, or a message is produced to it
    described = partq("stream", "describe", stream)
    produced = partq("produce", stream, "--key", "k", "--body", "b")
    # Then both exit 1 saying how to create it
    for result in (described, produced):
        assert result.returncode == 1
        assert_one_line_error(result, "does not exist", f"partq stream create {stream}")


def test_etcd_down_exits_1(partq: Run) -> None:
    # Given etcd endpoints where nothing listens
    env = {"PARTQ_ETCD_ENDPOINTS": f"http://127.0.0.1:{free_port()}"}
    # When streams are listed
    result = partq("stream", "list", env=env)
    # Then partq exits 1 asking whether etcd is running
    assert result.returncode == 1
    assert_one_line_error(result, "cannot reach etcd", "is it running")


def test_delete_needs_yes_then_removes_the_stream(
    partq: Run, created: StreamSpec, registry: Registry
) -> None:
    # Given a created stream
    # When it is deleted without --yes
    refused = partq("stream", "delete", created.name)
    # Then nothing happens and partq exits 2
    assert refused.returncode == 2
    assert "--yes" in refused.stderr
    assert registry.read_spec(created.name) == created
    # When it is deleted with --yes
    deleted = partq("stream", "delete", created.name, "--yes")
    # Then it is gone
    assert deleted.returncode == 0, deleted.stderr
    assert partq("stream", "describe", created.name).returncode == 1


# -- produce ---------------------------------------------------------------------------------


def test_produce_from_file_prints_summary_and_fills_the_queues(
    partq: Run, created: StreamSpec, tmp_path: Path
) -> None:
    # Given a file of 40 JSON lines over 10 keys
    keys = [f"order-{i % 10}" for i in range(40)]
    source = write_lines(tmp_path / "in.jsonl", [{"key": k, "body": {"n": 1}} for k in keys])
    # When it is produced
    result = partq("produce", created.name, "--from", str(source), "--partitions", "8")
    # Then partq exits 0 with the summary
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("sent 40, confirmed 40, failed 0, invalid 0, ")
    assert result.stderr == ""
    # And describe --json shows each partition's messages where partition_for puts them
    expected = collections.Counter(partition_for(k, 8) for k in keys)
    queues = describe(partq, created.name)["queues"]
    assert isinstance(queues, list)
    assert {q["partition"]: q["messages"] for q in queues} == {p: expected[p] for p in range(8)}


def test_produce_checks_a_whole_file_before_sending_any_line(
    partq: Run, created: StreamSpec, tmp_path: Path, registry: Registry, rabbitmq: str
) -> None:
    # Given a file whose fourth line has a header AMQP cannot carry (a lone surrogate)
    good = [{"key": "a", "body": "1"}, {"key": "b", "body": "2"}, {"key": "c", "body": "3"}]
    source = tmp_path / "in.jsonl"
    lines = [json.dumps(line) for line in good]
    lines.append('{"key": "d", "body": "4", "headers": {"h": "\\ud800"}}')
    source.write_text("\n".join(lines) + "\n")
    # When it is produced
    result = partq("produce", created.name, "--from", str(source))
    # Then nothing is sent: one line names the bad line and what to do, exit 2
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("partq: error: line 4: header 'h' is not valid UTF-8")
    assert "nothing sent" in result.stderr and result.stderr.count("\n") == 1
    assert queued(registry, rabbitmq, created.name) == 0
    # And from stdin the lines before it are sent, and the error says so
    piped = partq("produce", created.name, stdin="\n".join(lines) + "\n")
    assert piped.returncode == 2, piped.stderr
    assert piped.stdout.startswith("sent 3, confirmed 3, failed 0, invalid 1, ")
    assert piped.stderr.startswith("partq: error: line 4: header 'h'")
    assert "the 3 lines before it were sent (3 confirmed)" in piped.stderr
    assert queued(registry, rabbitmq, created.name) == 3


def test_produce_with_an_invalid_line_exits_nonzero(
    partq: Run, created: StreamSpec, tmp_path: Path, registry: Registry, rabbitmq: str
) -> None:
    # Given a file whose second line is not JSON and fourth has no body
    source = write_lines(
        tmp_path / "in.jsonl",
        [{"key": "a", "body": "1"}, "{not json", {"key": "b", "body": "2"}, {"key": "c"}],
    )
    # When it is produced with --skip-invalid
    result = partq("produce", created.name, "--from", str(source), "--skip-invalid")
    # Then the valid lines are sent, the summary counts the invalid ones, and it exits 1
    assert "sent 2, confirmed 2, failed 0, invalid 2, " in result.stdout
    assert "partq: skipped line 2: not JSON" in result.stderr
    assert "partq: skipped line 4: expected an object" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode == 1
    assert queued(registry, rabbitmq, created.name) == 2


def test_produce_refuses_a_wrong_partition_count(
    partq: Run, created: StreamSpec, registry: Registry, rabbitmq: str
) -> None:
    # Given a stream of 8 partitions
    # When a message is produced expecting 4
    result = partq("produce", created.name, "-k", "k", "-b", "b", "--partitions", "4")
    # Then partq exits 2 naming both counts, and nothing was sent
    assert result.returncode == 2
    assert_one_line_error(result, "8 partitions", "4 were configured")
    assert queued(registry, rabbitmq, created.name) == 0


# -- secrets -----------------------------------------------------------------------------------


def test_passwords_never_appear_in_any_output(partq: Run, created: StreamSpec) -> None:
    # Given an AMQP URL with a password, pointing at a port where no broker listens
    closed = f"amqp://guest:{SECRET}@127.0.0.1:{free_port()}/%2F"
    runs = {
        "create (env)": partq(
            "stream", "create", created.name, "-p", "8", env={"PARTQ_AMQP_URL": closed}
        ),
        "describe (flag)": partq("--amqp-url", closed, "stream", "describe", created.name),
        "produce (env)": partq(
            "produce", created.name, "-k", "k", "-b", "b", env={"PARTQ_AMQP_URL": closed}
        ),
        "produce (--debug)": partq(
            "--debug", "produce", created.name, "-k", "k", "-b", "b", env={"PARTQ_AMQP_URL": closed}
        ),
        "bad scheme": partq(
            "stream", "list", env={"PARTQ_AMQP_URL": f"http://guest:{SECRET}@127.0.0.1:1/"}
        ),
    }
    # Then each fails, says what is wrong, and shows the URL only with *** for the password
    for what, result in runs.items():
        assert result.returncode in (1, 2), what
        assert SECRET not in result.stdout, what
        assert SECRET not in result.stderr, what
        assert "guest:***@127.0.0.1" in result.stderr, what
    for what in ("create (env)", "produce (env)"):
        assert_one_line_error(runs[what], "cannot reach RabbitMQ", "is it running")
    # a password in argv (visible in `ps`) adds one warning line before the error
    warning, *error = runs["describe (flag)"].stderr.strip().splitlines()
    assert warning.startswith("partq: warning: --amqp-url holds a password"), warning
    assert "`ps`" in warning and "PARTQ_AMQP_URL_FILE" in warning
    assert len(error) == 1 and error[0].startswith("partq: error: cannot reach RabbitMQ")
    assert runs["bad scheme"].returncode == 2


def test_status_with_a_password_rabbitmq_refuses_says_so_and_exits_1(
    partq: Run, created: StreamSpec, rabbitmq: str
) -> None:
    # Given the machine's RabbitMQ URL with a wrong password
    parts = urllib.parse.urlsplit(rabbitmq)
    user = parts.username or "guest"
    wrong = parts._replace(netloc=f"{user}:{SECRET}@{parts.hostname}:{parts.port or 5672}")
    # When `partq status` runs with it
    result = partq("status", created.name, env={"PARTQ_AMQP_URL": urllib.parse.urlunsplit(wrong)})
    # Then it exits 1 with one line: RabbitMQ refused the login, of which user, at which URL,
    # the password left out
    assert result.returncode == 1, result.stdout
    assert_one_line_error(
        result, "authentication failed", f"refused the login of user {user!r}", f"{user}:***@"
    )
    assert SECRET not in result.stdout + result.stderr


def test_describe_json_has_what_the_text_form_shows(partq: Run, stream: str) -> None:
    # Given a stream that dead-letters
    created = partq("stream", "create", stream, "-p", "2", "--on-failure", "dead-letter")
    assert created.returncode == 0, created.stderr
    # When it is described as text and as JSON
    text = partq("stream", "describe", stream)
    doc = describe(partq, stream)
    # Then both say what it does on failure
    assert "on failure dead-letter" in text.stdout
    assert doc["on_failure"] == "dead-letter"


def test_list_says_so_when_there_is_no_stream(partq: Run) -> None:
    # Given an etcd holding no stream
    with LocalEtcd() as empty:
        # When the streams are listed
        result = partq("stream", "list", env={"PARTQ_ETCD_ENDPOINTS": empty.endpoint})
        as_json = partq("stream", "list", "--json", env={"PARTQ_ETCD_ENDPOINTS": empty.endpoint})
    # Then it says there are none and exits 0 (JSON: an empty list)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no streams: create one with `partq stream create NAME -p N`"
    assert json.loads(as_json.stdout) == []
