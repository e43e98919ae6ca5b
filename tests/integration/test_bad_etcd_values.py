"""Bad input in etcd and on the command line: partq refuses it or ignores it, and never dies.

Each test drives real processes (``partq coordinator``, ``partq consume``) or a
real :class:`StreamCoordinator` against the private etcd and the local RabbitMQ,
writes the bad value with the etcd client directly, and observes etcd, the
processes' logs, ``/metrics``, ``/readyz`` and ``partq status`` in bounded polls.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops import admin
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer import StreamSpec
from partq.producer.registry import Registry
from prometheus_client import REGISTRY

from partq.kernel import keys
from partq.kernel.errors import MalformedValue, StreamNotFound
from partq.kernel.local import free_port
from partq.kernel.settings import Settings

from .groups.harness import PARTQ, ROOT, Proc, wait_until

pytestmark = [pytest.mark.integration]

P = 4
HANDLER = "examples.handlers:noop_handler"
WAIT = 20.0


def http_get(url: str) -> tuple[int, str]:
    """(status, body); (0, "") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


@dataclass
class Daemons:
    """``partq`` processes of this test, each ended by its own PID."""

    tmp: Path
    settings: Settings
    procs: list[Proc] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
        env.update(
            {
                "PARTQ_ETCD_ENDPOINTS": self.settings.etcd_endpoints,
                "PARTQ_AMQP_URL": self.settings.amqp.url,
                "PYTHONPATH": str(ROOT),
            }
        )
        return env

    def start(self, name: str, *args: str, argv0: list[str] | None = None) -> Proc:
        port = free_port()
        log = self.tmp / f"{name}.log"
        command = [*(argv0 or [str(PARTQ)]), *args, "--http-port", str(port)]
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                command, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=self.env(), cwd=ROOT
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        self.ports[name] = port
        return proc

    def coordinator(self, stream: str, name: str = "coordinator") -> Proc:
        return self.start(name, "coordinator", stream, "--settle", "0.2", "--ttl", "2")

    def consumer(self, stream: str, member: str) -> Proc:
        args = ["consume", stream, "--handler", HANDLER, "--member-id", member]
        return self.start(member, *args, "--ttl", "2", "--drain-timeout", "5")

    def get(self, name: str, path: str) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.ports[name]}{path}")

    def partq(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(PARTQ), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid}) ---\n{p.tail(60)}" for p in self.procs)


@pytest.fixture
def daemons(settings: Settings, tmp_path: Path) -> Iterator[Daemons]:
    d = Daemons(tmp_path, settings)
    yield d
    d.close()


@pytest.fixture
def stream(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[str]:
    admin.create_stream(registry, rabbitmq, StreamSpec(stream_name, P, "classic"))
    yield stream_name
    with contextlib.suppress(StreamNotFound, MalformedValue):  # a failed test left it so
        admin.delete(registry, rabbitmq, stream_name)
    registry.delete(stream_name)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("partq: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], result.stderr


def survived(*procs: Proc) -> bool:
    """True while every one runs; an AssertionError naming the first that exited."""
    for proc in procs:
        code = proc.popen.poll()
        if code is not None:
            raise AssertionError(f"{proc.name} exited with {code}:\n{proc.tail(30)}")
    return True


def owned_by(group: Group, members: set[str]) -> bool:
    """Every partition assigned to and claimed by one of ``members``, each owning some."""
    state = group.snapshot()
    assignment = {p: o for p, o in state.assignment.items() if p < P}
    claims = {p: c.member for p, c in state.claims.items() if p < P}
    return (
        set(state.members) == members
        and sorted(assignment) == list(range(P))
        and claims == assignment
        and set(assignment.values()) == members
    )


# -- member ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("member_id", ['evil"x', "CORP\\nancy", "two words", "line\nbreak", ""])
def test_a_bad_member_id_is_refused_with_exit_2(
    daemons: Daemons, registry: Registry, stream: str, member_id: str
) -> None:
    # Before: the consumer joined (and ran until killed: a timeout here), its id broke the
    # assignment JSON for every other consumer. Now it is refused before anything starts.
    argv = [str(PARTQ), "consume", stream, "--handler", HANDLER, "--member-id", member_id]
    result = subprocess.run(
        [*argv, "--http-port", "0"],
        env=daemons.env(),
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, "invalid member id")
    assert Group(registry.client, registry.where, stream).snapshot().members == {}


def test_a_bad_member_id_is_refused_by_move_and_drain(
    daemons: Daemons, stream: str, registry: Registry
) -> None:
    for args in (("move", stream, "-p", "0", "--to", 'evil"x'), ("drain", stream, "CORP\\nancy")):
        result = daemons.partq(*args)
        assert result.returncode == 2, result.stderr
        assert_one_line_error(result, "invalid member id")
    assert Group(registry.client, registry.where, stream).snapshot().requests == {}


# -- malformed values under the stream prefix ------------------------------------------------

INVALID_JSON = b'{"v": 1, "owner": "c1'  # cut short
WRONG_SHAPE = b'{"v": 1}'


def bad_keys(stream: str) -> list[tuple[str, str]]:
    """(kind, key) of every kind of group key: real ones (overwritten) and extra ones."""
    return [
        ("member", keys.member(stream, "ghost")),
        ("assignment", keys.assignment(stream, 1)),  # a real partition: healed by the leader
        ("assignment", keys.assignment(stream, 77)),  # outside the stream: stays
        ("assignment", keys.assignments(stream) + "junk"),  # no partition's key
        ("claim", keys.claim(stream, 2)),  # a real claim: healed by its owner
        ("claim", keys.claim(stream, 78)),
        ("claim", keys.claims(stream) + "7"),
        ("leader", keys.leader_prefix(stream) + "not-a-lease"),
        ("request", keys.request(stream, "rebalance")),
        ("request", keys.request(stream, "drain-c1")),
    ]


def malformed_count(daemons: Daemons, name: str, stream: str) -> dict[str, float]:
    """partq_etcd_malformed_values_total of ``stream`` by kind, from a process's /metrics."""
    status, body = daemons.get(name, "/metrics")
    assert status == 200
    found: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("partq_etcd_malformed_values_total{") and f'stream="{stream}"' in line:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[kind] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("bad", [INVALID_JSON, WRONG_SHAPE], ids=["invalid-json", "wrong-shape"])
def test_malformed_values_are_ignored_logged_counted_and_shown(
    daemons: Daemons, registry: Registry, stream: str, bad: bytes
) -> None:
    # Before: the coordinator's thread and the consumer died on the first one (the
    # coordinator exiting 0), and every restart died again on the snapshot.
    group = Group(registry.client, registry.where, stream, report=False)
    coordinator = daemons.coordinator(stream)
    consumer = daemons.consumer(stream, "c1")
    try:
        wait_until(lambda: owned_by(group, {"c1"}), WAIT, what="c1 consuming every partition")

        # Given a malformed value of every kind of key, written behind partq's back
        for _kind, key in bad_keys(stream):
            registry.client.put(key, bad)

        # Then both survive, the overwritten assignment and claim are healed
        wait_until(
            lambda: survived(coordinator, consumer) and owned_by(group, {"c1"}),
            WAIT,
            what="the group healed",
        )
        # And each bad value is counted, per kind, by both
        expected = {"member": 1, "assignment": 3, "claim": 3, "leader": 1, "request": 2}
        for name in ("coordinator", "c1"):
            wait_until(
                lambda name=name: malformed_count(daemons, name, stream) == expected,
                WAIT,
                what=f"{name} counting the malformed values",
            )
        # And logged once each, naming the key
        for proc in (coordinator, consumer):
            text = proc.log.read_text()
            for _kind, key in bad_keys(stream):
                assert text.count(f"malformed value at {key} (revision") == 1, (key, proc.tail())
        # And the coordinator is ready (the stream is fine), as is the consumer
        assert daemons.get("coordinator", "/readyz")[0] == 200
        assert daemons.get("c1", "/readyz")[0] == 200

        # And partq status shows the ones still there, in text and in JSON
        persistent = {key for kind, key in bad_keys(stream)} - {
            keys.assignment(stream, 1),
            keys.claim(stream, 2),
        }
        shown = daemons.partq("status", stream, "--json")
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        assert {m["key"] for m in report["malformed"]} == persistent
        assert all(m["kind"] and m["error"] for m in report["malformed"])
        assert sorted(report["assignment"].values()) == ["c1"] * P
        text = daemons.partq("status", stream)
        assert text.returncode == 0, text.stderr
        assert "malformed keys (8)" in text.stdout
        assert all(key in text.stdout for key in persistent)
        # And deleting keys partq never uses is no event either
        registry.client.delete(keys.assignments(stream) + "junk")
        registry.client.delete(keys.claims(stream) + "7")

        # When both restart with the bad values still there
        assert coordinator.terminate() == 0, coordinator.tail()
        assert consumer.terminate() == 0, consumer.tail()
        coordinator = daemons.coordinator(stream, "coordinator-2")
        consumer = daemons.consumer(stream, "c1")
        # Then they come up and consume again: no crash loop
        wait_until(
            lambda: survived(coordinator, consumer) and daemons.get("c1", "/readyz")[0] == 200,
            WAIT,
            what="the consumer ready",
        )
        wait_until(
            lambda: survived(coordinator, consumer) and owned_by(group, {"c1"}),
            WAIT,
            what="c1 consuming after restart",
        )
    except AssertionError:
        print(daemons.logs())
        raise


# -- a stream deleted, or its spec malformed, under a running coordinator ------------------


@pytest.mark.parametrize("how", ["deleted", "malformed-spec"])
def test_the_coordinator_is_not_ready_while_its_stream_is_missing(
    daemons: Daemons, registry: Registry, stream: str, how: str
) -> None:
    # Before: /readyz stayed 200, and after a delete-and-recreate it never led again.
    spec = registry.read_spec(stream)
    group = Group(registry.client, registry.where, stream)
    members: list[Session] = []
    coordinator = daemons.coordinator(stream)
    try:
        wait_until(lambda: daemons.get("coordinator", "/readyz")[0] == 200, WAIT, what="ready")

        # When the stream goes away (its keys deleted) or its spec is overwritten with junk
        if how == "deleted":
            registry.delete(stream)
        else:
            registry.client.put(keys.spec(stream), b"{not json")

        # Then the coordinator stays up, not ready, says why in its log and on its page
        wait_until(lambda: daemons.get("coordinator", "/readyz")[0] == 503, WAIT, what="not ready")
        assert coordinator.alive()
        wait_until(lambda: "missing" in coordinator.log.read_text(), WAIT, what="a log line")
        # (the status page answers 503 with the reason: partq.cli.web)
        status, page = daemons.get("coordinator", "/")
        assert status == 503, page
        assert ("does not exist" if how == "deleted" else keys.spec(stream)) in page, page
        if how == "malformed-spec":
            shown = daemons.partq("status", stream)
            assert shown.returncode == 1
            assert_one_line_error(shown, keys.spec(stream))

        # When the stream is back
        if how == "deleted":
            registry.create(spec)
        else:
            registry.client.put(keys.spec(stream), spec.to_json())
        # Then it is ready again and leads: a member that joins is given every partition
        wait_until(lambda: daemons.get("coordinator", "/readyz")[0] == 200, WAIT, what="ready")
        session = Session(registry.client, registry.where, ttl=5)
        members.append(session)
        group.join(session, "m1")
        wait_until(
            lambda: sorted(group.snapshot().assignment.values()) == ["m1"] * P,
            WAIT,
            what="the assignment after the stream came back",
        )
        assert coordinator.alive()
    except AssertionError:
        print(daemons.logs())
        raise
    finally:
        for session in members:
            session.close()


# -- the coordinator's thread -----------------------------------------------------------------

DYING = textwrap.dedent(
    """
    import sys
    from partq.coordinator.leader.service import StreamCoordinator

    def _run(self):
        raise RuntimeError("injected death of the coordinator thread")

    StreamCoordinator._run = _run
    from partq.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_a_coordinator_whose_thread_dies_exits_nonzero(daemons: Daemons, stream: str) -> None:
    # Before: the process noticed the dead thread and exited 0 (looking like a clean stop).
    proc = daemons.start(
        "dying", "coordinator", stream, "--ttl", "2", argv0=[sys.executable, "-c", DYING]
    )
    code = proc.popen.wait(WAIT)
    text = proc.log.read_text()
    assert code == 1, text
    assert "Traceback" in text and "injected death of the coordinator thread" in text, text


def test_an_unexpected_error_in_a_campaign_is_retried(
    registry: Registry, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the exception ended the thread; nothing led the stream any more.
    failures = [RuntimeError("injected failure while leading")]
    lead = StreamCoordinator._lead

    def flaky(self: StreamCoordinator, event: Any) -> None:
        if failures:
            raise failures.pop()
        lead(self, event)

    monkeypatch.setattr(StreamCoordinator, "_lead", flaky)
    coordinator = StreamCoordinator(registry, stream, CoordinatorConfig(ttl=2, settle=0.1))
    coordinator.start()
    group = Group(registry.client, registry.where, stream)
    session = Session(registry.client, registry.where, ttl=5)
    try:
        group.join(session, "m1")
        wait_until(
            lambda: sorted(group.snapshot().assignment.values()) == ["m1"] * P,
            WAIT,
            what="an assignment after the failure",
        )
        assert not failures and coordinator.is_alive()
        assert sample("partq_coordinator_failures_total", stream=stream) >= 1
    finally:
        session.close()
        coordinator.stop()
        coordinator.join(10)


# -- metrics of several streams in one coordinator --------------------------------------------


def sample(name: str, **labels: str) -> float:
    return sum(
        s.value
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def assignment_series(stream: str) -> set[tuple[str, str]]:
    return {
        (s.labels["partition"], s.labels["member"])
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == "partq_assignment_info" and s.labels["stream"] == stream and s.value == 1
    }


def test_two_streams_led_by_one_coordinator_keep_each_others_assignment_series(
    registry: Registry, stream_name: str
) -> None:
    # Before: each stream's export cleared the other's partq_assignment_info series.
    streams = [f"{stream_name}-a", f"{stream_name}-b"]
    for name in streams:
        registry.create(StreamSpec(name, P))
    coordinators: list[StreamCoordinator] = []
    sessions: list[Session] = []
    try:
        for name in streams:
            coordinator = StreamCoordinator(registry, name, CoordinatorConfig(ttl=2, settle=0.1))
            coordinator.start()
            coordinators.append(coordinator)
            session = Session(registry.client, registry.where, ttl=5)
            sessions.append(session)
            Group(registry.client, registry.where, name).join(session, f"m-{name[-1]}")
        expected = {name: {(str(p), f"m-{name[-1]}") for p in range(P)} for name in streams}
        wait_until(
            lambda: all(assignment_series(name) == expected[name] for name in streams),
            WAIT,
            what="both streams' assignment series",
        )
        # When one stream's coordinator stops leading
        coordinators[0].stop()
        coordinators[0].join(10)
        # Then its series go, and the other stream's stay
        assert assignment_series(streams[0]) == set()
        assert assignment_series(streams[1]) == expected[streams[1]]
    finally:
        for session in sessions:
            session.close()
        for coordinator in coordinators:
            coordinator.stop()
            coordinator.join(10)
        for name in streams:
            registry.delete(name)
