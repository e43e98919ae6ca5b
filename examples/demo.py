"""The demo: an end-to-end run on a private etcd and the local RabbitMQ.

Run from the repository's root, where ``examples`` is importable: ``python -m examples.demo``.

Creates a stream, runs a coordinator and consumers as separate processes,
produces keyed sequences the whole time, scales consumers 1→2→3, stops one
gracefully, kills one with SIGKILL, and prints what happened: moves per
step, handoff gaps, lost messages, order violations.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import click
from partq.coordinator.ops.admin import create_stream, delete
from partq.coordinator.store.group import Group
from partq.producer.contract import StreamSpec
from partq.producer.ledger import Receipt
from partq.producer.publisher import Producer
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.amqp import AmqpURL, target
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings

__all__ = ["demo", "run_demo"]

HOME = Path(__file__).resolve().parents[1]  # the folder that holds the examples package


def _wait(what: str, predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"demo: timed out after {timeout:.0f}s waiting for {what}")


def run_demo(
    amqp_url: AmqpURL,
    *,
    partitions: int = 12,
    keys: int = 40,
    rate: int = 400,
    ttl: int = 3,
    echo: Callable[[str], None] = click.echo,
) -> bool:
    """Run the demo; True when nothing was lost and no order was broken."""
    work = Path(tempfile.mkdtemp(prefix="partq-demo-"))
    record = work / "handled.jsonl"
    stream = f"demo-{uuid.uuid4().hex[:6]}"
    amqp = target(amqp_url)
    tls = {  # the children connect as this process does
        f"PARTQ_AMQP_{name.upper()}": str(value)
        for name, value in vars(amqp.tls).items()
        if value not in (None, False)
    }
    with LocalEtcd() as etcd:
        overrides: dict[str, Any] = {k.removeprefix("PARTQ_").lower(): v for k, v in tls.items()}
        settings = Settings.load(None, etcd_endpoints=etcd.endpoint, amqp_url=amqp.url, **overrides)
        registry = Registry.connect(settings)
        spec = StreamSpec(stream, partitions, "quorum")
        create_stream(registry, amqp_url, spec)
        echo(f"etcd on {etcd.endpoint}; stream {stream}: {partitions} partitions (quorum)")
        env = {
            **os.environ,
            "PARTQ_ETCD_ENDPOINTS": etcd.endpoint,
            "PARTQ_AMQP_URL": amqp.url,
            **tls,
            "PARTQ_RECORD": str(record),
        }
        processes = _Processes(work, env, stream, ttl)
        load = _Load(spec, amqp_url, keys, rate)
        steps = _Steps(Group(registry.client, registry.where, stream), partitions, echo)
        try:
            _scale(processes, load, steps, ttl)
        finally:
            load.stop()
        sent = load.sent()
        try:
            _wait(
                "every message to be handled", lambda: not audit.lost(sent, audit.load(record)), 60
            )
        except TimeoutError as e:
            echo(str(e))  # the report below says what is missing
        processes.stop()
        records = audit.load(record)
        delete(registry, amqp_url, stream)
        registry.close()
    ok = _report(sent, records, len(load.failures), echo)
    echo(f"logs and record in {work}")
    return ok


def _scale(processes: _Processes, load: _Load, steps: _Steps, ttl: int) -> None:
    """The story: one consumer, out to three, one stopped, one killed; producing from the
    first step on."""
    processes.start("coordinator", "coordinator", "--settle", "0.5")
    processes.consumer("c1")
    steps.step("1 consumer", {"c1"})
    load.start()
    processes.consumer("c2")
    steps.step("scale out to 2", {"c1", "c2"})
    processes.consumer("c3")
    steps.step("scale out to 3", {"c1", "c2", "c3"})
    processes.running["c3"].send_signal(signal.SIGTERM)
    steps.step("SIGTERM c3 (graceful drain)", {"c1", "c2"})
    processes.running["c3"].wait(30)
    processes.running["c2"].kill()
    steps.step(f"SIGKILL c2 (lease TTL {ttl}s)", {"c1"}, timeout=30 + ttl)
    time.sleep(1.0)  # the survivor handles what the killed one left


class _Processes:
    """The demo's coordinator and consumers, each ``python -m partq`` with its log in ``work``."""

    def __init__(self, work: Path, env: dict[str, str], stream: str, ttl: int) -> None:
        self.work, self.env, self.stream, self.ttl = work, env, stream, ttl
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: str, *args: str) -> None:
        argv = [sys.executable, "-m", "partq", command, self.stream, *args]
        argv += ["--ttl", str(self.ttl), "--http-port", "0"]
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
        self.running[name] = subprocess.Popen(
            argv,
            env={**self.env, "PARTQ_MEMBER_ID": name},
            stdout=log,
            stderr=log,
            cwd=HOME,  # where the handler's module, examples.handlers, is found
        )
        log.close()

    def consumer(self, name: str) -> None:
        self.start(
            name, "consume", "--handler", "examples.handlers:record_handler", "--member-id", name
        )

    def stop(self) -> None:
        """SIGTERM each one still running; SIGKILL one that takes over 30 s."""
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


class _Load:
    """Keyed sequences published by a thread: ``keys`` keys, ``rate`` messages a second."""

    def __init__(self, spec: StreamSpec, amqp_url: AmqpURL, keys: int, rate: int) -> None:
        self.spec, self.amqp_url, self.keys, self.rate = spec, amqp_url, keys, rate
        self.published: dict[str, list[int]] = {f"user-{k}": [] for k in range(keys)}
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def sent(self) -> list[tuple[str, int]]:
        return [(key, seq) for key, seqs in sorted(self.published.items()) for seq in seqs]

    def _note(self, future: Future[Receipt]) -> None:
        error = future.exception()
        if error is not None:
            self.failures.append(error)

    def _produce(self) -> None:
        with Producer(self.spec, amqp_url=self.amqp_url) as producer:
            seq = 0
            while not self._stop.is_set():
                for key, seqs in self.published.items():
                    seqs.append(seq)
                    producer.publish(key, str(seq)).add_done_callback(self._note)
                seq += 1
                time.sleep(self.keys / self.rate)
            producer.flush(30)


class _Steps:
    """Waits for each step's group to settle; says how long it took and what moved."""

    def __init__(self, group: Group, partitions: int, echo: Callable[[str], None]) -> None:
        self.group, self.partitions, self.echo = group, partitions, echo
        self.previous: dict[int, str] = {}

    def step(self, title: str, members: set[str], timeout: float = 30) -> None:
        began = time.monotonic()
        _wait(f"{title} to settle", lambda: self.settled(members), timeout)
        assignment = self.group.snapshot().assignment
        moved = sum(1 for p, o in assignment.items() if self.previous.get(p) not in (None, o))
        self.previous = dict(assignment)
        counts = {m: sum(1 for o in assignment.values() if o == m) for m in sorted(members)}
        took = time.monotonic() - began
        self.echo(f"{title:<34} settled in {took:4.1f}s  moved {moved:2d}  {counts}")

    def settled(self, members: set[str]) -> bool:
        """Exactly ``members``, every partition assigned to one and claimed by it, balanced."""
        state = self.group.snapshot()
        if set(state.members) != members:
            return False
        owners = [state.assignment.get(p) for p in range(self.partitions)]
        claims = [state.claims.get(p) for p in range(self.partitions)]
        counts = [owners.count(m) for m in members]
        return (
            all(o in members for o in owners)
            and all(c is not None and c.member == o for c, o in zip(claims, owners, strict=True))
            and max(counts) - min(counts) <= 1
        )


def _report(
    sent: list[tuple[str, int]],
    records: list[dict[str, Any]],
    failures: int,
    echo: Callable[[str], None],
) -> bool:
    """Print what happened; True when nothing was lost, reordered or owned twice."""
    lost = audit.lost(sent, records)
    disorder = audit.order_violations(records)
    overlaps = audit.overlaps(records)
    gaps = [g * 1000 for g in audit.handoff_gaps(records)]
    unique = len({(r["key"], r["seq"]) for r in records})
    echo("")
    echo(
        f"published {len(sent)} (failed publishes: {failures}), handled {len(records)} "
        f"({unique} unique, {len(records) - unique} redelivered duplicates)"
    )
    if gaps:
        echo(
            f"owner changes seen in the record: {len(gaps)}; gap between owners "
            f"p50 {audit.percentile(gaps, 50):.0f} ms, max {max(gaps):.0f} ms"
        )
    echo(
        f"lost = {len(lost)}, order violations = {len(disorder)}, "
        f"overlapping owners = {len(overlaps)}"
    )
    return not (lost or disorder or overlaps or failures)


@click.command()
@click.option("--partitions", type=click.IntRange(1, 256), default=12, show_default=True)
@click.option("--ttl", type=click.IntRange(min=1), default=3, show_default=True)
def demo(partitions: int, ttl: int) -> None:
    """End-to-end demo on a private etcd and the local RabbitMQ (about a minute).

    RabbitMQ is PARTQ_AMQP_URL's (default amqp://guest:guest@127.0.0.1:5672/%2F)."""
    ok = run_demo(Settings.load().amqp, partitions=partitions, ttl=ttl)
    raise click.exceptions.Exit(0 if ok else 1)


if __name__ == "__main__":
    demo()
