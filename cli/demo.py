"""``partq demo``: an end-to-end run on a private etcd and the local RabbitMQ.

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

from cli.context import Context, pass_context
from consumers import audit
from coordinator.admin import create_stream, delete
from coordinator.group import Group
from kernel.amqp import AmqpURL, target
from kernel.local import LocalEtcd
from kernel.settings import Settings
from producer.contract import StreamSpec
from producer.publisher import Producer, Receipt
from producer.registry import Registry

__all__ = ["demo", "run_demo"]


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
    processes: dict[str, subprocess.Popen[bytes]] = {}
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
        group = Group(registry.client, registry.where, stream)
        env = {
            **os.environ,
            "PARTQ_ETCD_ENDPOINTS": etcd.endpoint,
            "PARTQ_AMQP_URL": amqp.url,
            **tls,
            "PARTQ_RECORD": str(record),
        }
        exe = [sys.executable, "-m", "cli"]

        def start(name: str, *args: str) -> None:
            log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
            processes[name] = subprocess.Popen(
                [*exe, *args], env={**env, "PARTQ_MEMBER_ID": name}, stdout=log, stderr=log
            )
            log.close()

        def consumer(name: str) -> None:
            start(
                name,
                "consume",
                stream,
                "--handler",
                "consumers.examples:record_handler",
                "--member-id",
                name,
                "--ttl",
                str(ttl),
                "--http-port",
                "0",
            )

        def settled(members: set[str]) -> bool:
            state = group.snapshot()
            if set(state.members) != members:
                return False
            owners = [state.assignment.get(p) for p in range(partitions)]
            claims = [state.claims.get(p) for p in range(partitions)]
            counts = [owners.count(m) for m in members]
            return (
                all(o in members for o in owners)
                and all(
                    c is not None and c.member == o for c, o in zip(claims, owners, strict=True)
                )
                and max(counts) - min(counts) <= 1
            )

        published: dict[str, list[int]] = {f"user-{k}": [] for k in range(keys)}
        stop_producing = threading.Event()
        failures: list[BaseException] = []

        def note_failure(future: Future[Receipt]) -> None:
            error = future.exception()
            if error is not None:
                failures.append(error)

        def produce() -> None:
            with Producer(spec, amqp_url=amqp_url) as producer:
                seq = 0
                while not stop_producing.is_set():
                    for k in range(keys):
                        key = f"user-{k}"
                        published[key].append(seq)
                        producer.publish(key, str(seq)).add_done_callback(note_failure)
                    seq += 1
                    time.sleep(keys / rate)
                producer.flush(30)

        moves: list[str] = []
        previous: dict[int, str] = {}

        def step(title: str, members: set[str], timeout: float = 30) -> None:
            began = time.monotonic()
            _wait(f"{title} to settle", lambda: settled(members), timeout)
            assignment = group.snapshot().assignment
            moved = sum(1 for p, o in assignment.items() if previous.get(p) not in (None, o))
            previous.clear()
            previous.update(assignment)
            counts = {m: sum(1 for o in assignment.values() if o == m) for m in sorted(members)}
            took = time.monotonic() - began
            line = f"{title:<34} settled in {took:4.1f}s  moved {moved:2d}  {counts}"
            moves.append(line)
            echo(line)

        producer_thread = threading.Thread(target=produce, daemon=True)
        try:
            start(
                "coordinator",
                "coordinator",
                stream,
                "--settle",
                "0.5",
                "--http-port",
                "0",
                "--ttl",
                str(ttl),
            )
            consumer("c1")
            step("1 consumer", {"c1"})
            producer_thread.start()
            consumer("c2")
            step("scale out to 2", {"c1", "c2"})
            consumer("c3")
            step("scale out to 3", {"c1", "c2", "c3"})
            processes["c3"].send_signal(signal.SIGTERM)
            step("SIGTERM c3 (graceful drain)", {"c1", "c2"})
            processes["c3"].wait(30)
            processes["c2"].kill()
            step(f"SIGKILL c2 (lease TTL {ttl}s)", {"c1"}, timeout=30 + ttl)
            time.sleep(1.0)
        finally:
            stop_producing.set()
            if producer_thread.is_alive():
                producer_thread.join(60)
        sent = [(key, seq) for key, seqs in sorted(published.items()) for seq in seqs]
        try:
            _wait(
                "every message to be handled", lambda: not audit.lost(sent, audit.load(record)), 60
            )
        except TimeoutError as e:
            echo(str(e))  # the report below says what is missing
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        records = audit.load(record)
        delete(registry, amqp_url, stream)
        registry.close()
    lost = audit.lost(sent, records)
    disorder = audit.order_violations(records)
    overlaps = audit.overlaps(records)
    gaps = [g * 1000 for g in audit.handoff_gaps(records)]
    unique = len({(r["key"], r["seq"]) for r in records})
    echo("")
    echo(
        f"published {len(sent)} (failed publishes: {len(failures)}), handled {len(records)} "
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
    echo(f"logs and record in {work}")
    return not (lost or disorder or overlaps or failures)


@click.command()
@click.option("--partitions", type=click.IntRange(1, 256), default=12, show_default=True)
@click.option("--ttl", type=click.IntRange(min=1), default=3, show_default=True)
@pass_context
def demo(ctx: Context, partitions: int, ttl: int) -> None:
    """End-to-end demo on a private etcd and the local RabbitMQ (about a minute)."""
    ok = run_demo(ctx.settings.amqp, partitions=partitions, ttl=ttl)
    raise click.exceptions.Exit(0 if ok else 1)
