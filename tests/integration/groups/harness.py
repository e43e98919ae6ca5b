"""Run consumers and coordinators as separate OS processes, produce keyed sequences, wait.

Processes are started with ``subprocess.Popen`` and ended by their own PID only.
``wait_until`` polls the *test's observation* (etcd state, record files) in a
bounded loop; the product itself never polls.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pika
from partq.consumers.broker.port import Delivery
from partq.coordinator.store.group import Group, GroupState
from partq.producer import Producer, StreamSpec
from partq.producer.topology import declare_stream, delete_stream

from examples import audit as checker
from partq.kernel.errors import EtcdUnavailable
from tests.polling import wait_until

__all__ = [
    "PREFETCH",
    "Fleet",
    "Proc",
    "SequenceProducer",
    "balanced",
    "one_quorum_partition",
    "record_of",
    "wait_until",
]

ROOT = Path(__file__).resolve().parents[3]
PARTQ = ROOT / ".venv" / "bin" / "partq"
HANDLERS = "tests.integration.groups.recorder"
PREFETCH = 100  # every consumer's: a crash leaves at most this many unacked per partition


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc; gone counts as not)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = [
            Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2].split()[0]
            for t in tasks
        ]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def freeze(self, timeout: float = 5.0) -> float:
        """SIGSTOP, and the time it took hold: once every thread shows stopped. A time read
        before the signal is early by as long as this process was descheduled before
        sending it (seen in CI under load: calls the frozen process began in that gap
        counted as begun inside its freeze, overlapping the next owner's). A process gone
        already is not frozen: the time is now."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while self.alive() and not _stopped(self.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not stopped {timeout}s after SIGSTOP")
            time.sleep(0.001)
        return time.time()

    def terminate(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit in time."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(10)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Fleet:
    """This test's processes; ``close()`` ends every one still running, by PID."""

    stream: str
    tmp: Path
    etcd: str
    amqp: str
    record: Path
    env: dict[str, str] = field(default_factory=dict)  # e.g. this identity's credentials
    procs: list[Proc] = field(default_factory=list)

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PARTQ_ETCD_ENDPOINTS": self.etcd,
                "PARTQ_AMQP_URL": self.amqp,
                "PYTHONPATH": str(ROOT),
                "PARTQ_RECORD": str(self.record),
            }
        )
        env.update(self.env)
        env.update(extra)
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        return self.process(name, [str(PARTQ), *args], env)

    def process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` with this fleet's settings; ended by ``close`` like the others."""
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=out, env=env or self._env(), cwd=ROOT)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def consumer(
        self, member: str, *, ttl: int = 2, handler: str = "record", extra: tuple[str, ...] = ()
    ) -> Proc:
        args = ["--debug", "consume", self.stream, "--handler", f"{HANDLERS}:{handler}"]
        args += ["--member-id", member, "--ttl", str(ttl), "--http-port", "0"]
        args += ["--drain-timeout", "15", "--prefetch", str(PREFETCH), *extra]
        return self._start(member, args, self._env(PARTQ_MEMBER_ID=member))

    def coordinator(
        self,
        name: str = "coordinator",
        *,
        ttl: int = 2,
        settle: float = 0.3,
        extra: tuple[str, ...] = (),
    ) -> Proc:
        args = ["coordinator", self.stream, "--settle", str(settle), "--ttl", str(ttl)]
        args += ["--http-port", "0", *extra]
        return self._start(name, args, self._env())

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGCONT)
                proc.signal(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    def records(self) -> list[dict[str, Any]]:
        return checker.load(self.record)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid}) ---\n{p.tail()}" for p in self.procs)


class SequenceProducer(threading.Thread):
    """Publishes ``{"seq": n}`` for each of ``keys`` keys, round after round, until stopped.

    ``confirmed`` holds the (key, seq) pairs the broker confirmed; per key, seq n+1
    is published only after seq n is queued, so publish order is seq order.
    """

    def __init__(
        self,
        spec: StreamSpec,
        amqp: str,
        *,
        keys: int = 40,
        rate: float = 400.0,
        rounds: int | None = None,
        prefix: str = "",
        journal: TextIO | None = None,
    ) -> None:
        """``prefix`` goes before each key's name; each confirm is written to ``journal``
        as a line ``KEY SEQ`` (for a producer in a process of its own, killed at will)."""
        super().__init__(name="sequence-producer", daemon=True)
        self.spec = spec
        self.amqp = amqp
        self.keys = [f"{prefix}key-{i:03d}" for i in range(keys)]
        self.journal = journal
        self.rate = rate
        self.rounds = rounds
        self.halt = threading.Event()
        self.confirmed: set[tuple[str, int]] = set()
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self.sent = 0
        self.started = 0  # rounds begun

    def run(self) -> None:
        pause = len(self.keys) / self.rate
        with Producer(self.spec, amqp_url=self.amqp, name="partq-test-producer") as producer:
            seq = 0
            while not self.halt.is_set() and (self.rounds is None or seq < self.rounds):
                began = time.monotonic()
                self.started = seq + 1
                for key in self.keys:
                    body = json.dumps({"key": key, "seq": seq}).encode()
                    future = producer.publish(key, body, message_id=f"{key}:{seq}")
                    future.add_done_callback(self._done(key, seq))
                    self.sent += 1
                seq += 1
                self.halt.wait(max(0.0, pause - (time.monotonic() - began)))
            producer.flush(30)

    def _done(self, key: str, seq: int) -> Callable[[Any], None]:
        def done(future: Any) -> None:
            error = future.exception()
            with self._lock:
                if error is None:
                    self.confirmed.add((key, seq))
                    if self.journal is not None:
                        self.journal.write(f"{key} {seq}\n")
                        self.journal.flush()
                else:
                    self.failed.append(f"{key}:{seq}: {error}")

        return done

    def stop(self) -> None:
        self.halt.set()
        self.join(60)

    def published(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self.confirmed)


def balanced(group: Group, partitions: int, members: set[str]) -> GroupState | None:
    """The group's state if ``members`` are exactly its members, balanced, claims held."""
    state = group.snapshot()
    if set(state.members) != members:
        return None
    claims = {p: c.member for p, c in state.claims.items()}
    if checker.balance_problems(partitions, members, state.assignment, claims):
        return None
    return state


def balanced_yet(group: Group, partitions: int, members: set[str]) -> bool:
    """:func:`balanced` for a wait through an etcd fault: False, not an error, while etcd
    cannot answer (a member down, a leader being elected)."""
    try:
        return balanced(group, partitions, members) is not None
    except EtcdUnavailable:
        return False


@contextlib.contextmanager
def one_quorum_partition(amqp_url: str, name: str) -> Iterator[StreamSpec]:
    """A stream ``name`` of one quorum partition, declared on ``amqp_url`` (no registry, no
    etcd: for tests that drive ``partq.consumers.broker.connection.Broker`` directly), deleted
    after."""
    spec = StreamSpec(name, 1, "quorum")
    with pika.BlockingConnection(pika.URLParameters(amqp_url)) as connection:
        declare_stream(connection, spec)
    try:
        yield spec
    finally:
        with pika.BlockingConnection(pika.URLParameters(amqp_url)) as connection:
            delete_stream(connection, spec)


def consumers_by_queue(rabbitmqctl: Callable[..., str]) -> Counter[str]:
    """How many consumers each queue has (``rabbitmqctl list_consumers``, one call), the
    waiting ones of a single-active-consumer queue included."""
    out = rabbitmqctl("list_consumers", "-q", "--no-table-headers")
    return Counter(line.split("\t", 1)[0] for line in out.splitlines())


def record_of(delivery: Delivery, member: str) -> dict[str, Any]:
    """The audit record (``examples.audit``) of a ``key:seq`` delivery handled now."""
    key, seq = delivery.body.decode().split(":")
    return {
        "key": key,
        "seq": int(seq),
        "start": time.time(),
        "member": member,
        "redelivered": delivery.redelivered,
    }
