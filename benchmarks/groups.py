# ruff: noqa: E501, RUF001  (Markdown tables and the units in them)
"""Consumer-group benchmarks (issue 3): handoff gap, failover, throughput, ordering.

    .venv/bin/python -m benchmarks.groups [--quick] [--only handoff,failover,throughput,retry,restart]

Uses a private etcd (LocalEtcd), the machine's RabbitMQ (PARTQ_AMQP_URL, default
guest@127.0.0.1:5672) and, for the broker-restart cell, a private RabbitMQ node
started from the same installation. Consumers and coordinators run as
``partq`` subprocesses; handled messages are recorded by
``benchmarks.recording:record``. Writes the section "## Consumer groups
(issue 3)" of docs/benchmarks.md (``--no-write`` to only print it).
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
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika

from coordinator.admin import create_stream, delete
from coordinator.group import Group
from kernel.local import LocalEtcd, free_port
from kernel.settings import Settings
from producer.contract import StreamSpec
from producer.publisher import Producer
from producer.registry import Registry

REPO = Path(__file__).resolve().parent.parent
PARTQ = str(Path(sys.executable).parent / "partq")
AMQP = os.environ.get("PARTQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
RECORD_HANDLER = "benchmarks.recording:record"
NOOP_HANDLER = "consumers.examples:noop_handler"
SECTION = "## Consumer groups (issue 3)"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rec:
    member: str
    partition: int
    key: str
    seq: int
    start: float
    end: float
    attempt: int
    redelivered: bool
    ok: bool


def read_records(paths: Iterable[Path]) -> list[Rec]:
    out: list[Rec] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            f = line.split()
            if len(f) != 9:
                continue  # a line cut by kill -9
            out.append(
                Rec(f[0], int(f[1]), f[2], int(f[3]), float(f[4]), float(f[5]), int(f[6]),
                    f[7] == "1", f[8] == "ok")
            )  # fmt: skip
    out.sort(key=lambda r: r.start)
    return out


def order_stats(recs: list[Rec], confirmed: set[tuple[str, int]]) -> dict[str, int]:
    """Violations: a key's seq going backwards among first handlings; duplicates: extra ok handlings."""
    ok = Counter((r.key, r.seq) for r in recs if r.ok)
    first: dict[tuple[str, int], float] = {}
    for r in recs:  # sorted by start
        first.setdefault((r.key, r.seq), r.start)
    per_key: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for (key, seq), start in first.items():
        per_key[key].append((start, seq))
    violations = 0
    for seqs in per_key.values():
        seqs.sort()
        top = -1
        for _, seq in seqs:
            if seq < top:
                violations += 1
            top = max(top, seq)
    return {
        "handled_ok": sum(ok.values()),
        "duplicates": sum(c - 1 for c in ok.values()),
        "violations": violations,
        "lost": len(confirmed - set(ok)),
        "redelivered": sum(1 for r in recs if r.redelivered),
        "failed_attempts": sum(1 for r in recs if not r.ok),
    }


def ownership_changes(recs: list[Rec]) -> list[dict[str, Any]]:
    """Per partition, each change of handling member: old owner's last end → new owner's first start."""
    by_part: dict[int, list[Rec]] = defaultdict(list)
    for r in recs:
        by_part[r.partition].append(r)
    moves = []
    for p, rs in sorted(by_part.items()):
        cur = rs[0].member
        last_end = rs[0].end
        for r in rs[1:]:
            if r.member != cur:
                moves.append({"partition": p, "from": cur, "to": r.member,
                              "old_last_end": last_end, "new_first_start": r.start,
                              "gap": r.start - last_end})  # fmt: skip
                cur = r.member
                last_end = r.end
            else:
                last_end = max(last_end, r.end)
    return moves


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1) + 0.4999)))
    return s[i]


# -- environment ------------------------------------------------------------------------


class Bench:
    def __init__(self, etcd: LocalEtcd, workdir: Path) -> None:
        self.etcd = etcd
        self.dir = workdir
        self.settings = Settings(etcd_endpoints=etcd.endpoint, amqp_url=AMQP)  # type: ignore[arg-type]
        self.registry = Registry.connect(self.settings)
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, amqp: str, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "PARTQ_ETCD_ENDPOINTS": self.etcd.endpoint,
            "PARTQ_AMQP_URL": amqp,
            "PYTHONPATH": str(REPO),
            **extra,
        }

    def stream(self, tag: str, partitions: int, queue_type: str, amqp: str = AMQP) -> StreamSpec:
        spec = StreamSpec(f"bench-{tag}-{uuid.uuid4().hex[:6]}", partitions, queue_type)  # type: ignore[arg-type]
        create_stream(self.registry, amqp, spec)
        return spec

    def drop(self, spec: StreamSpec, amqp: str = AMQP) -> None:
        try:
            delete(self.registry, amqp, spec.name)
        except Exception as e:
            log(f"could not delete {spec.name}: {e}")

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs.append(p)
        return p

    def coordinator(
        self, spec: StreamSpec, amqp: str = AMQP, settle: float = 1.0
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            f"coord-{spec.name}",
            [PARTQ, "coordinator", spec.name, "--settle", str(settle), "--http-port", "0"],
            self.env(amqp),
        )

    def consumer(
        self,
        spec: StreamSpec,
        member: str,
        record: Path | None,
        *,
        amqp: str = AMQP,
        ttl: int = 5,
        prefetch: int = 100,
        handler: str = RECORD_HANDLER,
        http_port: int = 0,
        **extra: str,
    ) -> subprocess.Popen[bytes]:
        env = self.env(amqp, PARTQ_MEMBER_ID=member,
                       PARTQ_BENCH_RECORD=str(record or self.dir / "none.rec"), **extra)  # fmt: skip
        cmd = [PARTQ, "consume", spec.name, "--handler", handler, "--member-id", member,
               "--ttl", str(ttl), "--http-port", str(http_port), "--prefetch", str(prefetch)]  # fmt: skip
        return self.spawn(f"{spec.name}-{member}", cmd, env)

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

    def stop_all(self) -> None:
        self.stop(self.procs, timeout=15)
        self.procs.clear()

    def settled(self, spec: StreamSpec, members: list[str], timeout: float) -> float | None:
        """Wait until exactly ``members`` are registered, the assignment is balanced and claimed."""
        group = Group(self.registry.client, self.registry.where, spec.name)
        P = spec.partitions
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                s = group.snapshot()
            except Exception:
                time.sleep(0.2)
                continue
            counts = Counter(s.assignment.values())
            if (
                set(s.members) == set(members)
                and len(s.assignment) == P
                and set(counts) == set(members)
                and max(counts.values()) - min(counts.values()) <= 1
                and all(p in s.claims and s.claims[p].member == s.assignment[p] for p in range(P))
            ):
                return time.time()
            time.sleep(0.05)
        return None

    def snapshot(self, spec: StreamSpec) -> Any:
        return Group(self.registry.client, self.registry.where, spec.name).snapshot()


class Load(threading.Thread):
    """Publishes ``key:seq:`` messages over ``keys`` keys at ``rate`` msg/s with the SDK."""

    def __init__(self, spec: StreamSpec, rate: float, amqp: str = AMQP, keys: int = 100) -> None:
        super().__init__(daemon=True)
        self.spec, self.rate, self.amqp, self.keys = spec, rate, amqp, keys
        self.halt = threading.Event()
        self.futures: list[tuple[str, int, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Producer(self.spec, amqp_url=self.amqp, window=1000, reconnect_timeout=90) as prod:
                seqs = [0] * self.keys
                n = 0
                t0 = time.monotonic()
                while not self.halt.is_set():
                    target = int((time.monotonic() - t0) * self.rate)
                    while n < target and not self.halt.is_set():
                        k = n % self.keys
                        key = f"k{k:03d}"
                        seq = seqs[k]
                        seqs[k] += 1
                        self.futures.append((key, seq, prod.publish(key, f"{key}:{seq}:".encode())))
                        n += 1
                    time.sleep(0.005)
                prod.flush(120)
        except BaseException as e:
            self.error = e
            log(f"load producer failed: {e!r}")

    def finish(self) -> set[tuple[str, int]]:
        self.halt.set()
        self.join(150)
        ok = set()
        for key, seq, fut in self.futures:
            if fut.done() and fut.exception() is None:
                ok.add((key, seq))
        if len(ok) != len(self.futures):
            log(
                f"load: {len(self.futures) - len(ok)} of {len(self.futures)} publishes not confirmed"
            )
        return ok


def wait_handled(paths: list[Path], confirmed: set[tuple[str, int]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = {(r.key, r.seq) for r in read_records(paths) if r.ok}
        if confirmed <= got:
            return True
        time.sleep(0.5)
    return False


# -- 1. planned scale-out handoff -------------------------------------------------------


def handoff(b: Bench, queue_type: str, rate: float, dwell: float) -> dict[str, Any]:
    spec = b.stream("handoff", 12, queue_type)
    recdir = b.dir / spec.name
    recdir.mkdir()
    paths = [recdir / f"c{i}.rec" for i in (1, 2, 3)]
    coord = b.coordinator(spec)
    cons = [b.consumer(spec, "c1", paths[0])]
    assert b.settled(spec, ["c1"], 60), "c1 never settled"
    load = Load(spec, rate)
    load.start()
    time.sleep(dwell)
    steps = []
    for n in (2, 3):
        t = time.time()
        cons.append(b.consumer(spec, f"c{n}", paths[n - 1]))
        done = b.settled(spec, [f"c{i}" for i in range(1, n + 1)], 60)
        steps.append({"to": n, "settled_after": None if done is None else done - t})
        time.sleep(dwell)
    confirmed = load.finish()
    drained = wait_handled(paths, confirmed, 60)
    b.stop([*cons, coord])
    recs = read_records(paths)
    moves = ownership_changes(recs)
    stats = order_stats(recs, confirmed)
    b.drop(spec)
    return {"queue_type": queue_type, "stream": spec.name, "published": len(confirmed),
            "drained": drained, "steps": steps, "moves": moves, "order": stats}  # fmt: skip


# -- 2. failover after kill -9 ------------------------------------------------------------


def failover(b: Bench, queue_type: str, ttl: int, rate: float, dwell: float) -> dict[str, Any]:
    spec = b.stream(f"failover{ttl}", 12, queue_type)
    recdir = b.dir / spec.name
    recdir.mkdir()
    paths = [recdir / "c1.rec", recdir / "c2.rec"]
    coord = b.coordinator(spec)
    c1 = b.consumer(spec, "c1", paths[0], ttl=ttl)
    c2 = b.consumer(spec, "c2", paths[1], ttl=ttl)
    assert b.settled(spec, ["c1", "c2"], 60), "c1+c2 never settled"
    load = Load(spec, rate)
    load.start()
    time.sleep(dwell)
    snap = b.snapshot(spec)
    orphans = sorted(p for p, m in snap.assignment.items() if m == "c2")
    t_kill = time.time()
    c2.send_signal(signal.SIGKILL)
    c2.wait()
    # watch the group: member key gone (lease expiry) → assignment → claims
    marks: dict[str, float] = {}
    deadline = time.monotonic() + ttl + 60
    while time.monotonic() < deadline and "claimed" not in marks:
        try:
            s = b.snapshot(spec)
        except Exception:
            time.sleep(0.05)
            continue
        now = time.time()
        if "member_gone" not in marks and "c2" not in s.members:
            marks["member_gone"] = now - t_kill
        if "assigned" not in marks and all(s.assignment.get(p) == "c1" for p in orphans):
            marks["assigned"] = now - t_kill
        if "claimed" not in marks and all(
            p in s.claims and s.claims[p].member == "c1" for p in orphans
        ):
            marks["claimed"] = now - t_kill
        time.sleep(0.02)
    time.sleep(dwell)
    confirmed = load.finish()
    drained = wait_handled(paths, confirmed, 60)
    b.stop([c1, coord])
    recs = read_records(paths)
    first: dict[int, float] = {}
    for r in recs:
        if r.member == "c1" and r.partition in orphans and r.start > t_kill:
            first.setdefault(r.partition, r.start - t_kill)
    stats = order_stats(recs, confirmed)
    b.drop(spec)
    return {"queue_type": queue_type, "ttl": ttl, "stream": spec.name, "orphans": orphans,
            "failover": first, "marks": marks, "published": len(confirmed),
            "drained": drained, "order": stats}  # fmt: skip


# -- 3. throughput: partq consumer vs raw pika ------------------------------------------


def prefill(spec: StreamSpec, n: int, size: int) -> float:
    body = b"x" * size
    t = time.monotonic()
    with Producer(spec, amqp_url=AMQP, window=1000) as prod:
        futs = [prod.publish(f"key-{i % 10000}", body) for i in range(n)]
        prod.flush(600)
    bad = sum(1 for f in futs if f.exception() is not None)
    assert bad == 0, f"{bad} prefill publishes failed"
    return n / (time.monotonic() - t)


def metric_handled(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("partq_consumer_messages_handled_total{") and '"ok"' in line
    )


def run_partq(b: Bench, spec: StreamSpec, n: int, prefetch: int) -> dict[str, float]:
    port = free_port()
    coord = b.coordinator(spec, settle=0.2)
    t0 = time.time()
    c = b.consumer(spec, "tp1", None, prefetch=prefetch, handler=NOOP_HANDLER, http_port=port)
    t_first = t_done = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            got = metric_handled(port)
        except Exception:
            got = 0
        now = time.time()
        if got > 0 and t_first is None:
            t_first = now
        if got >= n:
            t_done = now
            break
        if c.poll() is not None:
            raise RuntimeError(f"partq consumer exited with {c.returncode}")
        time.sleep(0.05)
    b.stop([c, coord])
    assert t_first is not None and t_done is not None, "partq consumer did not finish"
    return {"rate": n / (t_done - t_first), "total_s": t_done - t0, "startup_s": t_first - t0}


RAW = r"""
import json, sys, time, pika
url, n, prefetch, queues = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
conn = pika.BlockingConnection(pika.URLParameters(url))
state = {"count": 0, "first": None}
def on_message(ch, method, props, body):
    if state["first"] is None:
        state["first"] = time.time()
    ch.basic_ack(method.delivery_tag)
    state["count"] += 1
for q in queues:
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    ch.basic_consume(q, on_message)
t0 = time.time()
while state["count"] < n:
    conn.process_data_events(time_limit=0.1)
done = time.time()
print(json.dumps({"t0": t0, "first": state["first"], "done": done}))
conn.close()
"""


def run_raw(spec: StreamSpec, n: int, prefetch: int) -> dict[str, float]:
    queues = [spec.queue(p) for p in range(spec.partitions)]
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", RAW, AMQP, str(n), str(prefetch), *queues],
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rate": n / (r["done"] - r["first"]), "total_s": r["done"] - t0,
            "startup_s": r["first"] - t0}  # fmt: skip


def throughput(b: Bench, n: int, size: int) -> list[dict[str, Any]]:
    rows = []
    for queue_type in ("quorum", "classic"):
        for prefetch in (100, 1000):
            row: dict[str, Any] = {"queue_type": queue_type, "prefetch": prefetch}
            for impl in ("raw", "partq"):
                spec = b.stream(f"tp-{impl}", 8, queue_type)
                row[f"{impl}_publish_rate"] = prefill(spec, n, size)
                res = (
                    run_partq(b, spec, n, prefetch)
                    if impl == "partq"
                    else run_raw(spec, n, prefetch)
                )
                row[impl] = res
                log(f"throughput {queue_type} prefetch={prefetch} {impl}: {res['rate']:.0f} msg/s")
                b.drop(spec)
            row["ratio"] = row["partq"]["rate"] / row["raw"]["rate"]
            rows.append(row)
    return rows


# -- 4a. handler retry ------------------------------------------------------------------


def retry(b: Bench, queue_type: str, rate: float, seconds: float) -> dict[str, Any]:
    spec = b.stream("retry", 12, queue_type)
    recdir = b.dir / spec.name
    recdir.mkdir()
    paths = [recdir / "c1.rec"]
    coord = b.coordinator(spec)
    c1 = b.consumer(spec, "c1", paths[0], PARTQ_BENCH_FAIL_EVERY="50")
    assert b.settled(spec, ["c1"], 60)
    load = Load(spec, rate)
    load.start()
    time.sleep(seconds)
    confirmed = load.finish()
    drained = wait_handled(paths, confirmed, 90)
    b.stop([c1, coord])
    stats = order_stats(read_records(paths), confirmed)
    b.drop(spec)
    return {
        "queue_type": queue_type,
        "published": len(confirmed),
        "drained": drained,
        "order": stats,
    }


# -- 4b. broker restart on a private RabbitMQ node --------------------------------------


class PrivateRabbit:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.dist = free_port()
        self.epmd = free_port()
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
            "RABBITMQ_DIST_PORT": str(self.dist),
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
                ["/usr/lib/rabbitmq/bin/rabbitmq-server"], env=self.env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        while time.monotonic() - t < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"private RabbitMQ exited; see {self.base / 'server.out'}")
            try:
                pika.BlockingConnection(pika.URLParameters(self.url)).close()
                return time.monotonic() - t
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("private RabbitMQ did not accept connections")

    def ctl(self, *args: str) -> None:
        subprocess.run(["/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", self.node, *args],
                       env=self.env, capture_output=True, timeout=120, check=False)  # fmt: skip

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.ctl("stop")
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop_epmd(self) -> None:
        # the epmd this node's first start spawned listens on our private port: end it by pid
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{self.epmd}"], capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
        for pid in {int(m) for m in re.findall(r"pid=(\d+)", out)}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)


def broker_restart(
    b: Bench, rabbit: PrivateRabbit, queue_type: str, rate: float, dwell: float
) -> dict[str, Any]:
    spec = b.stream("restart", 12, queue_type, amqp=rabbit.url)
    recdir = b.dir / spec.name
    recdir.mkdir()
    paths = [recdir / "c1.rec", recdir / "c2.rec"]
    coord = b.coordinator(spec, amqp=rabbit.url)
    cons = [b.consumer(spec, f"c{i}", paths[i - 1], amqp=rabbit.url) for i in (1, 2)]
    assert b.settled(spec, ["c1", "c2"], 60)
    load = Load(spec, rate, amqp=rabbit.url)
    load.start()
    time.sleep(dwell)
    t = time.time()
    rabbit.stop()
    down = time.time() - t
    up = rabbit.start()
    time.sleep(dwell * 2)
    confirmed = load.finish()
    drained = wait_handled(paths, confirmed, 60)
    recs = read_records(paths)
    resumed = min((r.start for r in recs if r.start > t + down), default=float("nan")) - t
    b.stop([*cons, coord])
    stats = order_stats(recs, confirmed)
    b.drop(spec, amqp=rabbit.url)
    return {"queue_type": queue_type, "published": len(confirmed), "drained": drained,
            "stop_s": down, "start_s": up, "resumed_after_s": resumed, "order": stats}  # fmt: skip


# -- report -----------------------------------------------------------------------------


def fmt_ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.0f} ms"


def render(res: dict[str, Any], meta: dict[str, Any]) -> str:
    L = [SECTION, ""]
    L.append(f"Command: `{meta['command']}` — run {meta['date']} on RabbitMQ {meta['rabbitmq']}, "
             f"etcd {meta['etcd']} (private, LocalEtcd), Python {meta['python']}, partq at "
             f"{meta.get('commit', '?')}; "
             f"**2 cores, shared** with other engineers' concurrent test runs, so absolute numbers "
             f"are noisy; ratios are measured within one run. Consumers and coordinators are "
             f"`partq` subprocesses (coordinator `--settle 1`), handled messages are recorded by "
             f"`benchmarks.recording:record` (member, partition, key, seq, start, end).")  # fmt: skip
    L.append("")
    if "handoff" in res:
        L += ["### Handoff gap on planned scale-out (1 → 2 → 3 consumers, P = 12)", ""]
        L.append(f"Producer: SDK, {meta['rate']:.0f} msg/s, 100 keys, continuous. Gap = old owner's "
                 f"last handling (ack) of the partition → new owner's first handling of it. "
                 f"At this rate a partition gets a message every ≈ {12000 / meta['rate']:.0f} ms, "
                 f"which bounds the gap's resolution.")  # fmt: skip
        L += ["", "| queue type | runs | moved partitions | p50 | p99 | max | min | scale step settled after (s) |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for qt in ("quorum", "classic"):
            runs = [r for r in res["handoff"] if r["queue_type"] == qt]
            if not runs:
                continue
            gaps = [m["gap"] for r in runs for m in r["moves"]]
            settle = ", ".join(f"{s['settled_after']:.1f}" if s["settled_after"] else "never"
                               for r in runs for s in r["steps"])  # fmt: skip
            L.append(f"| {qt} | {len(runs)} | {len(gaps)} | {fmt_ms(pct(gaps, 50))} | "
                     f"{fmt_ms(pct(gaps, 99))} | {fmt_ms(max(gaps, default=float('nan')))} | "
                     f"{fmt_ms(min(gaps, default=float('nan')))} | {settle} |")  # fmt: skip
        L += ["", "(Expected moves per run: 6 at 1→2 and 4 at 2→3 = 10; a negative min would mean "
              "two members handled one partition at once.)", ""]  # fmt: skip
    if "failover" in res:
        L += ["### Failover after `kill -9` of one of 2 consumers (P = 12)", ""]
        L += [
            "Failover = kill instant → survivor's first handling of each orphaned partition. "
            "Member gone = the victim's member key disappeared (lease expiry); assigned / "
            "claimed = the leader reassigned all orphans / the survivor claimed them all.",
            "",
        ]
        L += ["| queue type | TTL | runs | orphaned partitions | failover p50 | max | member gone | assigned | claimed | failover − TTL (p50) |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in res["failover"]:
            groups[(r["queue_type"], r["ttl"])].append(r)
        for (qt, ttl), runs in sorted(groups.items()):
            fo = [v for r in runs for v in r["failover"].values()]
            missing = sum(len(r["orphans"]) - len(r["failover"]) for r in runs)

            def mark(k: str, runs: list[dict[str, Any]] = runs) -> str:
                v = [r["marks"][k] for r in runs if k in r["marks"]]
                return "/".join(f"{x:.1f} s" for x in v) if v else "never"

            L.append(f"| {qt} | {ttl} s | {len(runs)} | {sum(len(r['orphans']) for r in runs)}"
                     f"{f' ({missing} never handled)' if missing else ''} | "
                     f"{pct(fo, 50):.2f} s | {max(fo, default=float('nan')):.2f} s | {mark('member_gone')} | "
                     f"{mark('assigned')} | {mark('claimed')} | {pct(fo, 50) - ttl:+.2f} s |")  # fmt: skip
        L.append("")
    if "throughput" in res:
        L += ["### Consumer throughput: partq (no-op handler) vs raw pika, same run", ""]
        L += [f"{meta['n']:,} × {meta['size']} B persistent messages pre-filled with the SDK into a "
              f"fresh P = 8 stream for each measurement; one consumer process; rate = messages / "
              f"(last handled − first handled). Raw pika: `BlockingConnection`, one channel per "
              f"partition queue with `basic_qos(prefetch)`, `basic_consume`, manual `basic_ack` "
              f"per message. partq: `partq consume --handler consumers.examples:noop_handler "
              f"--prefetch N`, counted from its `/metrics`.", ""]  # fmt: skip
        L += ["| queue type | prefetch | raw pika msg/s | partq msg/s | ratio partq/raw | partq startup → first message |",
              "|---|---|---|---|---|---|"]  # fmt: skip
        for r in res["throughput"]:
            L.append(f"| {r['queue_type']} | {r['prefetch']} | {r['raw']['rate']:,.0f} | "
                     f"{r['partq']['rate']:,.0f} | **{r['ratio']:.2f}** | {r['partq']['startup_s']:.1f} s |")  # fmt: skip
        L.append("")
    L += ["### Per-key ordering by queue type × event (measured)", ""]
    L += ["Cells: order violations (a key's seq lower than one already handled, among first "
          "handlings) / duplicates (extra successful handlings) / lost, out of messages "
          "published in that run.", ""]  # fmt: skip
    L += ["| queue type | planned handoff | consumer crash (kill -9) | handler retry (1 in 50 fails once) | broker restart |",
          "|---|---|---|---|---|"]  # fmt: skip

    def cell(runs: list[dict[str, Any]]) -> str:
        if not runs:
            return "not measured"
        v = sum(r["order"]["violations"] for r in runs)
        d = sum(r["order"]["duplicates"] for r in runs)
        lost = sum(r["order"]["lost"] for r in runs)
        n = sum(r["published"] for r in runs)
        return f"{v} / {d} / {lost} of {n:,}"

    for qt in ("classic", "quorum"):
        row = [qt]
        for ev in ("handoff", "failover", "retry", "restart"):
            runs = [r for r in res.get(ev, []) if r["queue_type"] == qt]
            if ev == "restart" and not runs:
                row.append(f"not measured ({res.get('restart_error', 'not run')})")
            else:
                row.append(cell(runs))
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    if res.get("restart"):
        L.append("Broker restart: a private node (same installation, own node name/ports/mnesia), "
                 "graceful `rabbitmqctl stop` then start, with 2 consumers and the producer "
                 "running; " + "; ".join(
                     f"{r['queue_type']}: stop {r['stop_s']:.1f} s, start {r['start_s']:.1f} s, "
                     f"first handling {r['resumed_after_s']:.1f} s after the stop began"
                     for r in res["restart"]) + ".")  # fmt: skip
        L.append("")
    if meta.get("notes"):
        L += meta["notes"] + [""]
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def versions() -> dict[str, str]:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, check=False
            ).stdout.strip()
        except Exception:
            return "?"

    etcd = run(["etcd", "--version"]).splitlines()
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    return {
        "commit": run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
        + (" (with uncommitted changes)" if dirty else ""),
        "rabbitmq": run(["rabbitmqctl", "version"]) or "?",
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
    n = 20_000 if args.quick else 100_000
    size = 200
    dwell = 3.0
    workdir = Path(tempfile.mkdtemp(prefix="partq-bench-groups-"))
    log(f"work dir {workdir}")
    meta: dict[str, Any] = {
        "command": ".venv/bin/python -m benchmarks.groups" + (" --quick" if args.quick else "")
        + (f" --only {args.only}" if args.only != ap.get_default("only") else ""),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "rate": args.rate, "n": n, "size": size, "notes": [], **versions(),
    }  # fmt: skip
    res: dict[str, Any] = {}
    rabbit: PrivateRabbit | None = None

    def checkpoint() -> None:  # a hung later phase still leaves what was measured
        (workdir / "results.json").write_text(
            json.dumps({"meta": meta, "results": res}, indent=1, default=str)
        )
        if not args.no_write:
            write_section(REPO / "docs" / "benchmarks.md", render(res, meta))

    with LocalEtcd() as etcd:
        b = Bench(etcd, workdir)
        try:
            if "handoff" in only:
                res["handoff"] = []
                for qt in ("quorum", "classic"):
                    for i in range(reps):
                        r = handoff(b, qt, args.rate, dwell)
                        g = [m["gap"] for m in r["moves"]]
                        log(f"handoff {qt} #{i + 1}: {len(g)} moves, gaps ms "
                            f"{sorted(round(x * 1000) for x in g)} order {r['order']}")  # fmt: skip
                        res["handoff"].append(r)
                        checkpoint()
            if "failover" in only:
                res["failover"] = []
                for qt in ("quorum", "classic"):
                    for ttl in (2, 5):
                        for i in range(max(1, reps - 1)):
                            r = failover(b, qt, ttl, args.rate, dwell)
                            log(f"failover {qt} ttl={ttl} #{i + 1}: {r['failover']} marks "
                                f"{r['marks']} order {r['order']}")  # fmt: skip
                            res["failover"].append(r)
                            checkpoint()
            if "retry" in only:
                res["retry"] = []
                for qt in ("quorum", "classic"):
                    r = retry(b, qt, args.rate, 5.0)
                    log(f"retry {qt}: order {r['order']}")
                    res["retry"].append(r)
                    checkpoint()
            if "restart" in only:
                res["restart"] = []
                try:
                    rabbit = PrivateRabbit(workdir / "rabbit")
                    log(
                        f"private RabbitMQ {rabbit.node} on {rabbit.port} started in {rabbit.start():.1f}s"
                    )
                    for qt in ("quorum", "classic"):
                        r = broker_restart(b, rabbit, qt, args.rate, dwell)
                        log(f"restart {qt}: {r}")
                        res["restart"].append(r)
                        checkpoint()
                except Exception as e:
                    res["restart_error"] = f"{type(e).__name__}: {e}"
                    log(f"broker restart not measured: {e!r}")
                    checkpoint()
            if "throughput" in only:
                res["throughput"] = throughput(b, n, size)
                checkpoint()
        finally:
            b.stop_all()
            if rabbit is not None:
                rabbit.stop()
                rabbit.stop_epmd()
    (workdir / "results.json").write_text(
        json.dumps({"meta": meta, "results": res}, indent=1, default=str)
    )
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
