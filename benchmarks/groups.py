# ruff: noqa: E501, RUF001  (Markdown tables and the units in them)
"""Consumer-group benchmarks (issue 3): handoff gap, failover, throughput, ordering.

    .venv/bin/python -m benchmarks.groups [--quick] [--only handoff,failover,throughput,retry,restart]

Uses a private etcd (LocalEtcd), the machine's RabbitMQ (PARTQ_AMQP_URL, default
guest@127.0.0.1:5672) and, for the broker-restart cell, a private RabbitMQ node
started from the same installation. Consumers and coordinators run as ``partq``
subprocesses (``python -m partq``). Handlings are recorded and judged by the
product's own recorder and checker, the ones ``partq demo`` and the invariant
tests use: ``examples.handlers.record_handler`` (through
``benchmarks.recording:record``, which can also fail on demand) and
``examples.audit``. Writes the section "## Consumer groups (issue 3)" of
docs/benchmarks.md (``--no-write`` to only print it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pika
from partq.coordinator.ops.admin import create_stream, delete
from partq.coordinator.store.group import Group, GroupState
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.local import LocalEtcd, free_port
from partq.kernel.settings import Settings

REPO = Path(__file__).resolve().parent.parent
PARTQ = [sys.executable, "-m", "partq"]  # this tree's CLI, whatever the venv's script points at
AMQP = os.environ.get("PARTQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
RECORD_HANDLER = "benchmarks.recording:record"
NOOP_HANDLER = "examples.handlers:noop_handler"
SECTION = "## Consumer groups (issue 3)"
P = 12  # partitions of every scenario's stream but the throughput one


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def outcome(records: list[dict[str, Any]], confirmed: set[tuple[str, int]]) -> dict[str, int]:
    """The ordering cell of one run, by ``examples.audit``; duplicates: extra handlings."""
    unique = {(r["key"], r["seq"]) for r in records}
    return {
        "handled_ok": len(records),
        "duplicates": len(records) - len(unique),
        "violations": len(audit.order_violations(records)),
        "lost": len(audit.lost(confirmed, records)),
        "overlaps": len(audit.overlaps(records)),
        "redelivered": sum(1 for r in records if r["redelivered"]),
        "retried": sum(1 for r in records if r["attempt"] > 1),
    }


# -- environment ------------------------------------------------------------------------


class Bench:
    def __init__(self, etcd: LocalEtcd, workdir: Path) -> None:
        self.etcd = etcd
        self.dir = workdir
        settings = Settings(etcd_endpoints=etcd.endpoint, amqp_url=AMQP)  # type: ignore[arg-type]
        self.registry = Registry.connect(settings)
        self.procs: list[subprocess.Popen[bytes]] = []

    def stream(
        self,
        tag: str,
        partitions: int,
        queue_type: str,
        amqp: str = AMQP,
        on_failure: str = "dead-letter",
    ) -> StreamSpec:
        name = f"bench-{tag}-{uuid.uuid4().hex[:6]}"
        spec = StreamSpec(name, partitions, queue_type, on_failure=on_failure)  # type: ignore[arg-type]
        create_stream(self.registry, amqp, spec)
        return spec

    def drop(self, spec: StreamSpec, amqp: str = AMQP) -> None:
        try:
            delete(self.registry, amqp, spec.name)
        except Exception as e:
            log(f"could not delete {spec.name}: {e}")

    def spawn(self, name: str, args: list[str], amqp: str, **extra: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PARTQ_ETCD_ENDPOINTS": self.etcd.endpoint, "PARTQ_AMQP_URL": amqp}
        env |= {"PYTHONPATH": str(REPO), "PARTQ_RECORD_SLEEP": "0", **extra}  # no handler work
        with open(self.dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen([*PARTQ, *args], env=env, stdout=out, stderr=out, cwd=REPO)
        self.procs.append(p)
        return p

    def coordinator(
        self, spec: StreamSpec, amqp: str = AMQP, settle: float = 1.0, *extra: str
    ) -> subprocess.Popen[bytes]:
        args = ["coordinator", spec.name, "--settle", str(settle), "--http-port", "0", *extra]
        return self.spawn(f"coord-{spec.name}", args, amqp)

    def consumer(
        self,
        spec: StreamSpec,
        member: str,
        record: Path,
        *,
        amqp: str = AMQP,
        ttl: int = 5,
        prefetch: int = 100,
        handler: str = RECORD_HANDLER,
        http_port: int = 0,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        args = ["consume", spec.name, "--handler", handler, "--member-id", member]
        args += ["--ttl", str(ttl), "--http-port", str(http_port), "--prefetch", str(prefetch)]
        env |= {"PARTQ_MEMBER_ID": member, "PARTQ_RECORD": str(record)}
        return self.spawn(f"{spec.name}-{member}", args, amqp, **env)

    def stop(self, procs: Iterable[subprocess.Popen[bytes]], timeout: float = 30) -> None:
        procs = [p for p in procs if p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"pid {p.pid} ignored SIGTERM for {timeout}s: SIGKILL")
                p.kill()
                p.wait(5)

    def snapshot(self, spec: StreamSpec) -> GroupState:
        return Group(self.registry.client, self.registry.where, spec.name).snapshot()

    def settled(self, spec: StreamSpec, members: list[str], timeout: float) -> float | None:
        """When exactly ``members`` are registered, balanced and hold their claims."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                s = self.snapshot(spec)
                claims = {p: c.member for p, c in s.claims.items()}
                problems = audit.balance_problems(spec.partitions, members, s.assignment, claims)
                if set(s.members) == set(members) and not problems:
                    return time.time()
            time.sleep(0.05)
        return None


class Load(threading.Thread):
    """Publishes ``{"seq": n}`` over ``keys`` keys at ``rate`` msg/s with the SDK."""

    def __init__(self, spec: StreamSpec, rate: float, amqp: str = AMQP, keys: int = 100) -> None:
        super().__init__(daemon=True)
        self.spec, self.rate, self.amqp, self.keys = spec, rate, amqp, keys
        self.halt = threading.Event()
        self.futures: list[tuple[str, int, Any]] = []

    def run(self) -> None:
        try:
            with Producer(self.spec, amqp_url=self.amqp, window=1000, reconnect_timeout=90) as prod:
                n, t0 = 0, time.monotonic()
                while not self.halt.is_set():
                    while n < int((time.monotonic() - t0) * self.rate) and not self.halt.is_set():
                        key, seq = f"k{n % self.keys:03d}", n // self.keys
                        body = json.dumps({"seq": seq})
                        self.futures.append((key, seq, prod.publish(key, body)))
                        n += 1
                    time.sleep(0.005)
                prod.flush(120)
        except BaseException as e:
            log(f"load producer failed: {e!r}")

    def finish(self) -> set[tuple[str, int]]:
        self.halt.set()
        self.join(150)
        ok = {(k, s) for k, s, f in self.futures if f.done() and f.exception() is None}
        if len(ok) != len(self.futures):
            log(
                f"load: {len(self.futures) - len(ok)} of {len(self.futures)} publishes not confirmed"
            )
        return ok


class Run:
    """One scenario: a fresh P = 12 stream, its coordinator, consumers recording, the load."""

    def __init__(
        self,
        b: Bench,
        tag: str,
        queue_type: str,
        members: list[str],
        rate: float,
        amqp: str = AMQP,
        coordinator_args: tuple[str, ...] = (),
        on_failure: str = "dead-letter",
        **consumer: Any,
    ) -> None:
        self.b, self.queue_type, self.amqp, self.options = b, queue_type, amqp, consumer
        self.spec = b.stream(tag, P, queue_type, amqp, on_failure)
        self.record = b.dir / f"{self.spec.name}.jsonl"
        self.procs = {"coordinator": b.coordinator(self.spec, amqp, 1.0, *coordinator_args)}
        for member in members:
            self.add(member)
        assert b.settled(self.spec, members, 60), f"{members} never settled"
        self.load = Load(self.spec, rate, amqp)
        self.load.start()

    def add(self, member: str) -> None:
        self.procs[member] = self.b.consumer(
            self.spec, member, self.record, amqp=self.amqp, **self.options
        )

    def finish(self, timeout: float = 60) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Stop the load, wait for every confirmed message, stop; the records and the summary."""
        confirmed = self.load.finish()
        deadline = time.monotonic() + timeout
        while audit.lost(confirmed, audit.load(self.record)) and time.monotonic() < deadline:
            time.sleep(0.5)
        records = audit.load(self.record)
        self.b.stop(self.procs.values())
        self.b.drop(self.spec, self.amqp)
        summary = {
            "queue_type": self.queue_type,
            "stream": self.spec.name,
            "published": len(confirmed),
            "drained": not audit.lost(confirmed, records),
            "order": outcome(records, confirmed),
        }
        return records, summary


# -- the scenarios ------------------------------------------------------------------------


def alternate(
    rounds: int,
    run: Callable[[Bench, bool], dict[str, Any]],
    say: Callable[[bool, dict[str, Any]], str],
) -> dict[bool, list[dict[str, Any]]]:
    """``rounds`` times (``run(b, True)``, ``run(b, False)``), alternating, on one private etcd;
    each result logged with ``say``. What two modes are compared with, in one invocation."""
    results: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    with LocalEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        b = Bench(etcd, Path(tmp))
        try:
            for r in range(rounds):
                for mode in (True, False):
                    results[mode].append(res := run(b, mode))
                    log(f"round {r + 1}: {say(mode, res)}")
        finally:
            b.stop(b.procs)
    return results


def handoff(b: Bench, queue_type: str, rate: float, dwell: float) -> dict[str, Any]:
    """Planned scale-out 1 → 2 → 3 under load: the gap between owners of each moved partition."""
    run = Run(b, "handoff", queue_type, ["c1"], rate)
    time.sleep(dwell)
    steps = []
    for n in (2, 3):
        t = time.time()
        run.add(f"c{n}")
        done = b.settled(run.spec, [f"c{i}" for i in range(1, n + 1)], 60)
        steps.append({"to": n, "settled_after": None if done is None else done - t})
        time.sleep(dwell)
    records, summary = run.finish()
    return summary | {"steps": steps, "gaps": audit.handoff_gaps(records)}


def failover(
    b: Bench,
    queue_type: str,
    ttl: int,
    rate: float,
    dwell: float,
    standby: bool = False,
    freeze: bool = False,
) -> dict[str, Any]:
    """``kill -9`` (or, ``freeze``, SIGSTOP) of one of two consumers: when its partitions are
    handled again, and the steps. A frozen member is killed once that is measured."""
    extra = ("--standby",) if standby else ("--no-standby",)  # the baseline: lease expiry
    run = Run(b, f"failover{ttl}", queue_type, ["c1", "c2"], rate, coordinator_args=extra, ttl=ttl)
    time.sleep(dwell)
    orphans = sorted(p for p, m in b.snapshot(run.spec).assignment.items() if m == "c2")
    t_kill = time.time()
    run.procs["c2"].send_signal(signal.SIGSTOP if freeze else signal.SIGKILL)
    if not freeze:
        run.procs["c2"].wait()
    marks: dict[str, float] = {}  # member key gone (lease expiry) → reassigned → claimed
    deadline = time.monotonic() + ttl + 60
    while time.monotonic() < deadline and "claimed" not in marks:
        with contextlib.suppress(Exception):
            s, now = b.snapshot(run.spec), time.time() - t_kill
            if "c2" not in s.members:
                marks.setdefault("member_gone", now)
            if all(s.assignment.get(p) == "c1" for p in orphans):
                marks.setdefault("assigned", now)
            if all(p in s.claims and s.claims[p].member == "c1" for p in orphans):
                marks.setdefault("claimed", now)
        time.sleep(0.02)
    time.sleep(dwell)
    if freeze:  # measured: end it (its connection was dropped by the broker long ago)
        run.procs["c2"].send_signal(signal.SIGKILL)
        run.procs["c2"].wait()
    records, summary = run.finish()
    first: dict[int, float] = {}
    for r in records:
        if r["member"] == "c1" and r["partition"] in orphans and r["start"] > t_kill:
            first[r["partition"]] = min(first.get(r["partition"], math.inf), r["start"] - t_kill)
    return summary | {"ttl": ttl, "orphans": orphans, "failover": first, "marks": marks}


def retry(b: Bench, queue_type: str, rate: float, seconds: float) -> dict[str, Any]:
    """One consumer whose handler fails the first attempt of 1 message in 50."""
    run = Run(b, "retry", queue_type, ["c1"], rate, PARTQ_BENCH_FAIL_EVERY="50")
    time.sleep(seconds)
    return run.finish(timeout=90)[1]


def broker_restart(
    b: Bench, rabbit: PrivateRabbit, queue_type: str, rate: float, dwell: float
) -> dict[str, Any]:
    """A graceful stop and start of the (private) broker under load."""
    run = Run(b, "restart", queue_type, ["c1", "c2"], rate, amqp=rabbit.url)
    time.sleep(dwell)
    t = time.time()
    rabbit.stop()
    down = time.time() - t
    up = rabbit.start()
    time.sleep(dwell * 2)
    records, summary = run.finish()
    resumed = min((r["start"] for r in records if r["start"] > t + down), default=math.nan) - t
    return summary | {"stop_s": down, "start_s": up, "resumed_after_s": resumed}


# -- throughput: partq consumer vs raw pika: benchmarks.consume ------------------------------


# -- a private RabbitMQ node, for the broker restart ----------------------------------------


class PrivateRabbit:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.port, dist, self.epmd = free_port(), free_port(), free_port()
        self.node = f"partqbench{self.port}@localhost"
        for d in ("home", "mnesia", "log"):
            (base / d).mkdir(parents=True, exist_ok=True)
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {self.port}\nloopback_users = none\n"
        )
        self.env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist),
            "ERL_EPMD_PORT": str(self.epmd),
            "HOME": str(base / "home"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(base / "pid"),
            "RABBITMQ_CONF_ENV_FILE": str(base / "none.env"),
        }
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> float:
        t = time.monotonic()
        with open(self.base / "server.out", "ab") as out:
            self.process = subprocess.Popen(
                ["/usr/lib/rabbitmq/bin/rabbitmq-server"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while time.monotonic() - t < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"private RabbitMQ exited; see {self.base / 'server.out'}")
            try:
                pika.BlockingConnection(pika.URLParameters(self.url)).close()
                return time.monotonic() - t
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("private RabbitMQ did not accept connections")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        ctl = ["/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", self.node, "stop"]
        subprocess.run(ctl, env=self.env, capture_output=True, timeout=120, check=False)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop_epmd(self) -> None:
        # the epmd this node's first start spawned listens on our private port: end it by pid
        ss = ["ss", "-ltnpH", f"sport = :{self.epmd}"]
        out = subprocess.run(ss, capture_output=True, text=True, check=False).stdout
        for pid in {int(m) for m in re.findall(r"pid=(\d+)", out)}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)


# -- report -----------------------------------------------------------------------------


def ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.0f} ms"


def table(header: str, rows: Iterable[str]) -> list[str]:
    """A Markdown table from ``"a | b"`` strings."""
    return [
        f"| {header} |",
        "|" + "---|" * (header.count("|") + 1),
        *(f"| {r} |" for r in rows),
        "",
    ]


def render(res: dict[str, Any], meta: dict[str, Any]) -> str:
    nan, pct = math.nan, audit.percentile
    L = [SECTION, ""]
    L += [
        f"Command: `{meta['command']}` — run {meta['date']} on RabbitMQ {meta['rabbitmq']}, etcd {meta['etcd']} (private, LocalEtcd), Python {meta['python']}, partq at {meta.get('commit', '?')}; **2 cores, shared** with other engineers' concurrent test runs, so absolute numbers are noisy; ratios are measured within one run. Consumers and coordinators are `partq` subprocesses (coordinator `--settle 1`); every handling is recorded by `examples.handlers:record_handler` (member, partition, key, seq, pid, start, end) and judged by `examples.audit`, the recorder and checker of `partq demo` and the invariant tests.",
        "",
    ]
    if "handoff" in res:
        L += ["### Handoff gap on planned scale-out (1 → 2 → 3 consumers, P = 12)", ""]
        L += [
            f"Producer: SDK, {meta['rate']:.0f} msg/s, 100 keys, continuous. Gap = old owner's last handling (ack) of the partition → new owner's first handling of it (`audit.handoff_gaps`). At this rate a partition gets a message every ≈ {12000 / meta['rate']:.0f} ms, which bounds the gap's resolution.",
            "",
        ]
        rows = []
        for qt in ("quorum", "classic"):
            if runs := [r for r in res["handoff"] if r["queue_type"] == qt]:
                gaps = [g for r in runs for g in r["gaps"]]
                steps = [s["settled_after"] for r in runs for s in r["steps"]]
                settle = ", ".join(f"{s:.1f}" if s else "never" for s in steps)
                rows.append(
                    f"{qt} | {len(runs)} | {len(gaps)} | {ms(pct(gaps, 50))} | {ms(pct(gaps, 99))} | {ms(max(gaps, default=nan))} | {ms(min(gaps, default=nan))} | {settle}"
                )
        L += table(
            "queue type | runs | moved partitions | p50 | p99 | max | min | scale step settled after (s)",
            rows,
        )
        overlaps = sum(r["order"]["overlaps"] for r in res["handoff"])
        L += [
            f"(Expected moves per run: 6 at 1→2 and 4 at 2→3 = 10. Moments when two members handled one partition at once (`audit.overlaps`): {overlaps}.)",
            "",
        ]
    if "failover" in res:
        L += ["### Failover after `kill -9` of one of 2 consumers (P = 12)", ""]
        L += [
            "Failover = kill instant → survivor's first handling of each orphaned partition. Member gone = the victim's member key disappeared (lease expiry); assigned / claimed = the leader reassigned all orphans / the survivor claimed them all.",
            "",
        ]
        groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in res["failover"]:
            groups[(r["queue_type"], r["ttl"])].append(r)
        rows = []
        for (qt, ttl), runs in sorted(groups.items()):
            fo = [v for r in runs for v in r["failover"].values()]
            orphans = sum(len(r["orphans"]) for r in runs)
            missing = orphans - sum(len(r["failover"]) for r in runs)
            marks = " | ".join(
                "/".join(f"{r['marks'][k]:.1f} s" for r in runs if k in r["marks"]) or "never"
                for k in ("member_gone", "assigned", "claimed")
            )
            rows.append(
                f"{qt} | {ttl} s | {len(runs)} | {orphans}{f' ({missing} never handled)' if missing else ''} | {pct(fo, 50):.2f} s | {max(fo, default=nan):.2f} s | {marks} | {pct(fo, 50) - ttl:+.2f} s"
            )
        L += table(
            "queue type | TTL | runs | orphaned partitions | failover p50 | max | member gone | assigned | claimed | failover − TTL (p50)",
            rows,
        )
    if "throughput" in res:
        L += ["### Consumer throughput: partq (no-op handler) vs raw pika, same run", ""]
        L += [
            f"{meta['n']:,} × {meta['size']} B persistent messages pre-filled with the SDK into a fresh P = 8 stream for each measurement; one consumer process; rate = messages / (last handled − first handled). Raw pika: `BlockingConnection`, one channel per partition queue with `basic_qos(prefetch)`, `basic_consume`, manual `basic_ack` per message. partq: `partq consume --handler examples.handlers:noop_handler --prefetch N`, counted from its `/metrics`.",
            "",
        ]
        rows = [
            f"{r['queue_type']} | {r['prefetch']} | {r['raw']['rate']:,.0f} | {r['partq']['rate']:,.0f} | **{r['ratio']:.2f}** | {r['partq']['startup_s']:.1f} s"
            for r in res["throughput"]
        ]
        L += table(
            "queue type | prefetch | raw pika msg/s | partq msg/s | ratio partq/raw | partq startup → first message",
            rows,
        )
    L += ["### Per-key ordering by queue type × event (measured)", ""]
    L += [
        "Cells: order violations (`audit.order_violations`: a key's seq lower than one already handled, among first handlings) / duplicates (extra handlings) / lost (`audit.lost`), out of messages published in that run.",
        "",
    ]

    def cell(event: str, qt: str) -> str:
        if not (runs := [r for r in res.get(event, []) if r["queue_type"] == qt]):
            return (
                f"not measured ({res.get('restart_error', 'not run')})"
                if event == "restart"
                else "not measured"
            )
        v, d, lost = (
            sum(r["order"][k] for r in runs) for k in ("violations", "duplicates", "lost")
        )
        return f"{v} / {d} / {lost} of {sum(r['published'] for r in runs):,}"

    rows = [
        " | ".join([qt, *(cell(e, qt) for e in ("handoff", "failover", "retry", "restart"))])
        for qt in ("classic", "quorum")
    ]
    L += table(
        "queue type | planned handoff | consumer crash (kill -9) | handler retry (1 in 50 fails once) | broker restart",
        rows,
    )
    if res.get("restart"):
        restarts = "; ".join(
            f"{r['queue_type']}: stop {r['stop_s']:.1f} s, start {r['start_s']:.1f} s, first handling {r['resumed_after_s']:.1f} s after the stop began"
            for r in res["restart"]
        )
        L += [
            f"Broker restart: a private node (same installation, own node name/ports/mnesia), graceful `rabbitmqctl stop` then start, with 2 consumers and the producer running; {restarts}.",
            "",
        ]
    return "\n".join(L)


def write_section(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = old.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        # a hand-written "### Notes" subsection (interpretation) survives a re-run
        notes = next((i for i in range(start, end) if lines[i].startswith("### Notes")), end)
        kept = lines[notes:end]
        body = text.rstrip("\n").splitlines() + (["", *kept] if kept else []) + [""]
        new = "\n".join(lines[:start] + body + lines[end:]).rstrip("\n") + "\n"
    path.write_text(new)


def versions() -> dict[str, str]:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, check=False
            ).stdout.strip()
        except Exception:
            return "?"

    etcd = run("etcd", "--version").splitlines()
    dirty = run("git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no")
    commit = run("git", "-C", str(REPO), "rev-parse", "--short", "HEAD")
    return {
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "rabbitmq": run("rabbitmqctl", "version") or "?",
        "etcd": etcd[0].split()[-1] if etcd else "?",
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.groups", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and messages")
    ap.add_argument("--only", default="handoff,failover,throughput,retry,restart")
    ap.add_argument("--no-write", action="store_true", help="print the section, don't edit docs")
    ap.add_argument("--rate", type=float, default=2000.0)
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    reps = 1 if args.quick else 3
    n, size, dwell = (20_000 if args.quick else 100_000), 200, 3.0
    workdir = Path(tempfile.mkdtemp(prefix="partq-bench-groups-"))
    log(f"work dir {workdir}")
    command = ".venv/bin/python -m benchmarks.groups" + (" --quick" if args.quick else "")
    command += f" --only {args.only}" if args.only != ap.get_default("only") else ""
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"command": command, "date": date, "rate": args.rate, "n": n, "size": size, **versions()}
    res: dict[str, Any] = {}
    rabbit: PrivateRabbit | None = None

    def keep(event: str, r: Any) -> None:  # a hung later phase still leaves what was measured
        res.setdefault(event, []).append(r)
        log(f"{event}: {json.dumps(r, default=str)}")
        (workdir / "results.json").write_text(
            json.dumps({"meta": meta, "results": res}, indent=1, default=str)
        )
        if not args.no_write:
            write_section(REPO / "docs" / "benchmarks.md", render(res, meta))

    with LocalEtcd() as etcd:
        b = Bench(etcd, workdir)
        try:
            for qt in ("quorum", "classic") if "handoff" in only else ():
                for _ in range(reps):
                    keep("handoff", handoff(b, qt, args.rate, dwell))
            for qt in ("quorum", "classic") if "failover" in only else ():
                for ttl in (2, 5):
                    for _ in range(max(1, reps - 1)):
                        keep("failover", failover(b, qt, ttl, args.rate, dwell))
            for qt in ("quorum", "classic") if "retry" in only else ():
                keep("retry", retry(b, qt, args.rate, 5.0))
            if "restart" in only:
                try:
                    rabbit = PrivateRabbit(workdir / "rabbit")
                    log(
                        f"private RabbitMQ {rabbit.node} on {rabbit.port} started in {rabbit.start():.1f}s"
                    )
                    for qt in ("quorum", "classic"):
                        keep("restart", broker_restart(b, rabbit, qt, args.rate, dwell))
                except Exception as e:
                    res["restart_error"] = f"{type(e).__name__}: {e}"
                    log(f"broker restart not measured: {e!r}")
            if "throughput" in only:
                from benchmarks.consume import throughput  # it imports this module

                for row in throughput(b, n, size):
                    keep("throughput", row)
        finally:
            b.stop(b.procs, timeout=15)
            if rabbit is not None:
                rabbit.stop()
                rabbit.stop_epmd()
    text = render(res, meta)
    print(text)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", text)
        log("wrote docs/benchmarks.md")
    shutil.rmtree(workdir / "rabbit", ignore_errors=True)
    log(f"raw results: {workdir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
