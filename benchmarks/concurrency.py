# ruff: noqa: E501  (Markdown table lines)
"""Key-level concurrency (``--concurrency``): four measurements, one command each.

    .venv/bin/python -m benchmarks.concurrency [rate]  [--messages 6000] [--concurrency 1,64] [--handlers sleep_sync,sleep_async]
    .venv/bin/python -m benchmarks.concurrency scale   [--messages 12000] [--concurrency 16] [--members 3]
    .venv/bin/python -m benchmarks.concurrency noop    [--messages 30000] [--repeats 2] [--baseline b76c2c9]
    .venv/bin/python -m benchmarks.concurrency zipf    [--messages 6000] [--concurrency 64] [--exponent 1.1]
    .venv/bin/python -m benchmarks.concurrency keys    [--messages 1000000] [--concurrency 64]

(The planned handoff gap with ``--concurrency``: ``python -m benchmarks.planned --concurrency 64``.)

Each run uses a fresh P = 12 quorum stream, a private etcd, a coordinator and the machine's
RabbitMQ; a handler that waits ``WORK`` (20 ms) per message unless said otherwise;
prefetch 100. Rate = messages / (first handled -> last handled), from the consumers'
``/metrics``. Every table line carries the 1-minute load average: compare ratios taken
in the same run, not rates across runs.

- ``rate``: one consumer drains a pre-filled stream (1,000 uniform keys) with each
  ``--concurrency`` and each handler (``time.sleep`` or ``await asyncio.sleep``).
- ``scale``: ``--members`` consumers with ``--concurrency`` each against one consumer
  with the same, on a pre-filled stream (1,000 uniform keys); the coordinator assigns
  nothing until all have joined (``--min-members``), so each takes its share from the
  start.
- ``noop``: a no-op handler with ``--concurrency 1`` against the consumer before key-level
  concurrency existed (``--baseline``, a commit: its tree is exported and run with
  this venv), and with ``--concurrency 64``; interleaved, ``--repeats`` times; also the
  consumer's CPU seconds per 10k messages over the same span, which the machine's load
  moves far less than the rate.
- ``zipf``: keys drawn from Zipf(``--exponent``) over 1,000 keys (the hottest carries
  about 1 message in 6); reports the rate, the hottest key's rate (one message at a time:
  at most 1 / 20 ms), when the other keys were done, and the longest a message waited
  behind its own key (``partq_consumer_key_wait_seconds``, sampled) against the bound
  ``prefetch * ceil(P * prefetch / N) * h`` (docs/operations.md).
- ``keys``: every message of its own key (``--messages`` distinct keys), a no-op handler:
  the consumer's resident memory as the drain passes 1, 10, 25, 50, 75 and 90 %; a key is
  held only while it has a message held, so it should stay flat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from partq.consumers.handling.message import Message
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer

from benchmarks.consume import metric_handled, process_cpu
from benchmarks.groups import AMQP, NOOP_HANDLER, PARTQ, REPO, Bench, log
from examples import audit
from partq.kernel.local import LocalEtcd, free_port

P = 12
KEYS = 1000
WORK = 0.02  # seconds each handler call waits
PREFETCH = 100
RECORD_HANDLER = "benchmarks.recording:record"


def sleep_sync(message: Message) -> None:
    time.sleep(WORK)


async def sleep_async(message: Message) -> None:
    await asyncio.sleep(WORK)


def uniform(n: int) -> list[str]:
    return [f"key-{i % KEYS}" for i in range(n)]


def zipf(n: int, exponent: float, seed: int = 21) -> list[str]:
    weights = [1 / (k + 1) ** exponent for k in range(KEYS)]
    return [f"key-{k}" for k in random.Random(seed).choices(range(KEYS), weights=weights, k=n)]


def publish(spec: StreamSpec, keys: list[str]) -> None:
    with Producer(spec, amqp_url=AMQP, window=1000) as producer:
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            producer.publish_many(
                (key, f'{{"seq": {start + i}}}'.encode()) for i, key in enumerate(chunk)
            )
        producer.flush(600)


def load() -> float:
    return os.getloadavg()[0]


class Drain:
    """Consumers of one stream and their ``/metrics`` ports; :meth:`wait` times the drain."""

    def __init__(self, b: Bench, spec: StreamSpec, members: int = 1) -> None:
        """``members``: the leader assigns nothing until that many consumers have joined."""
        self.b, self.spec = b, spec
        coordinator = b.coordinator(spec, AMQP, 0.2, "--min-members", str(members))
        self.procs: list[subprocess.Popen[bytes]] = [coordinator]
        self.ports: list[int] = []
        self.cpu = math.nan  # the consumers' CPU seconds per 10k messages, once drained

    def consumer(self, member: str, handler: str, concurrency: int, **env: str) -> None:
        port = free_port()
        self.ports.append(port)
        if concurrency > 1:
            env["PARTQ_CONCURRENCY"] = str(concurrency)
        record = self.b.dir / f"{self.spec.name}.jsonl"
        proc = self.b.consumer(  # env holds only PARTQ_* names: none is a parameter
            self.spec,
            member,
            record,
            prefetch=PREFETCH,
            handler=handler,
            http_port=port,
            **env,  # type: ignore[arg-type]
        )
        self.procs.append(proc)

    def baseline(self, member: str, tree: Path) -> None:
        """A consumer run from ``tree`` (an exported older commit), no-op handler."""
        port = free_port()
        self.ports.append(port)
        env = {**os.environ, "PARTQ_ETCD_ENDPOINTS": self.b.etcd.endpoint, "PARTQ_AMQP_URL": AMQP}
        env |= {"PYTHONPATH": str(tree), "PARTQ_MEMBER_ID": member}
        args = ["consume", self.spec.name, "--handler", NOOP_HANDLER, "--member-id", member]
        args += ["--ttl", "5", "--http-port", str(port), "--prefetch", str(PREFETCH)]
        with open(self.b.dir / f"{self.spec.name}-{member}.log", "ab") as out:
            proc = subprocess.Popen([*PARTQ, *args], env=env, stdout=out, stderr=out, cwd=tree)
        self.procs.append(proc)
        self.b.procs.append(proc)

    def handled(self) -> float:
        total = 0.0
        for port in self.ports:
            with contextlib.suppress(Exception):
                total += metric_handled(port)
        return total

    def key_wait(self) -> float:
        """The longest ``partq_consumer_key_wait_seconds`` of the consumers now."""
        found = 0.0
        for port in self.ports:
            with contextlib.suppress(Exception):
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=2) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("partq_consumer_key_wait_seconds{"):
                            found = max(found, float(line.rsplit(" ", 1)[1]))
        return found

    def wait(
        self, n: int, timeout: float = 900, on_tick: Callable[[], None] = lambda: None
    ) -> float:
        """Messages per second, first handled to the ``n``-th; then every process stopped."""
        first = done = None
        cpu_first = cpu_done = 0.0
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and done is None:
                got = self.handled()
                now = time.time()
                if first is None and got > 0:
                    first, cpu_first = now, self._consumers_cpu()
                if got >= n:
                    done, cpu_done = now, self._consumers_cpu()
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"a process exited early: see {self.b.dir}")
                on_tick()
                time.sleep(0.05)
        finally:
            self.b.stop(self.procs)
            self.b.drop(self.spec)
        if first is None or done is None:
            raise RuntimeError(f"the consumers did not finish: see {self.b.dir}")
        self.cpu = (cpu_done - cpu_first) / n * 10_000
        return n / (done - first)

    def _consumers_cpu(self) -> float:
        """CPU seconds the consumer processes (not the coordinator) used so far."""
        return sum(process_cpu(p.pid) for p in self.procs[1:])


# -- the scenarios ------------------------------------------------------------------------


def rate(b: Bench, args: argparse.Namespace) -> None:
    print("| handler | --concurrency | msg/s | load (1 min) |\n|---|---|---|---|", flush=True)
    for handler in args.handlers.split(","):
        for level in (int(c) for c in args.concurrency.split(",")):
            spec = b.stream(f"cc-{level}", P, "quorum")
            publish(spec, uniform(args.messages))
            d = Drain(b, spec)
            d.consumer("c1", f"benchmarks.concurrency:{handler}", level)
            got = d.wait(args.messages)
            print(f"| `{handler}` | {level} | {got:.0f} | {load():.2f} |", flush=True)


def scale(b: Bench, args: argparse.Namespace) -> None:
    level = int(args.concurrency)
    rates = {}
    print("| consumers | --concurrency each | msg/s | load (1 min) |\n|---|---|---|---|")
    for members in (1, args.members):
        spec = b.stream(f"scale-{members}", P, "quorum")
        publish(spec, uniform(args.messages))
        d = Drain(b, spec, members)
        for i in range(members):
            d.consumer(f"c{i + 1}", "benchmarks.concurrency:sleep_sync", level)
        rates[members] = d.wait(args.messages)
        print(f"| {members} | {level} | {rates[members]:.0f} | {load():.2f} |", flush=True)
    ratio = rates[args.members] / rates[1]
    print(f"\n{args.members} consumers / 1: **{ratio:.2f}x** (target >= 2.4x)")


def export(commit: str) -> Path:
    """The tree of ``commit``, exported to a temporary directory."""
    tree = Path(tempfile.mkdtemp(prefix=f"partq-{commit[:8]}-"))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def noop(b: Bench, args: argparse.Namespace) -> None:
    tree = export(args.baseline)
    arms = (("baseline", 1), ("now", 1), ("now", 64))
    rates: dict[tuple[str, int], list[float]] = {arm: [] for arm in arms}
    cpus: dict[tuple[str, int], list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for code, level in arms:
            spec = b.stream(f"noop-{code}-{level}", P, "quorum")
            publish(spec, uniform(args.messages))
            d = Drain(b, spec)
            if code == "baseline":
                d.baseline("c1", tree)
            else:
                d.consumer("c1", NOOP_HANDLER, level)
            got = d.wait(args.messages)
            rates[(code, level)].append(got)
            cpus[(code, level)].append(d.cpu)
            log(
                f"noop {code} --concurrency {level}: {got:.0f} msg/s, {d.cpu:.2f} CPU s / 10k, load {load():.2f}"
            )
    base = statistics.median(rates[("baseline", 1)])
    base_cpu = statistics.median(cpus[("baseline", 1)])
    print(
        "| consumer | --concurrency | msg/s (each run) | median ÷ baseline | CPU s / 10k msgs (median) | baseline's CPU ÷ this |"
    )
    print("|---|---|---|---|---|---|")
    for (code, level), each in rates.items():
        median, cpu = statistics.median(each), statistics.median(cpus[(code, level)])
        name = f"before concurrency ({args.baseline})" if code == "baseline" else "this tree"
        runs = ", ".join(f"{r:.0f}" for r in each)
        print(
            f"| {name} | {level} | {runs} | {median / base:.2f}x | {cpu:.2f} | {base_cpu / cpu:.2f}x |"
        )


def skew(b: Bench, args: argparse.Namespace) -> None:
    keys = zipf(args.messages, args.exponent)
    hottest = max(set(keys), key=keys.count)
    spec = b.stream("zipf", P, "quorum")
    publish(spec, keys)
    d = Drain(b, spec)
    d.consumer("c1", RECORD_HANDLER, args.concurrency, PARTQ_RECORD_SLEEP=str(WORK))
    waits: list[float] = []
    got = d.wait(args.messages, on_tick=lambda: waits.append(d.key_wait()))
    records = audit.load(b.dir / f"{spec.name}.jsonl")
    hot = [r for r in records if r["key"] == hottest]
    rest = [r for r in records if r["key"] != hottest]
    t0 = min(r["start"] for r in records)
    hot_rate = len(hot) / (max(r["end"] for r in hot) - min(r["start"] for r in hot))
    rest_done = sorted(r["end"] - t0 for r in rest)
    bound = PREFETCH * math.ceil(P * PREFETCH / args.concurrency) * WORK
    print("| | value |\n|---|---|")
    print(
        f"| keys | Zipf({args.exponent}) over {KEYS}; {args.messages:,} messages, the hottest ({hottest}) {len(hot):,} |"
    )
    print(f"| --concurrency | {args.concurrency} |")
    print(f"| rate, all keys | {got:.0f} msg/s |")
    print(
        f"| the hottest key's rate | {hot_rate:.1f} msg/s (one at a time: at most {1 / WORK:.0f}) |"
    )
    print(
        f"| other keys: 50 % / 99 % / all handled after | {audit.percentile(rest_done, 50):.1f} s / {audit.percentile(rest_done, 99):.1f} s / {rest_done[-1]:.1f} s |"
    )
    print(f"| all handled after | {max(r['end'] for r in records) - t0:.1f} s |")
    print(
        f"| longest wait behind its own key (sampled) | {max(waits, default=0.0):.1f} s; bound {bound:.0f} s |"
    )
    print(f"| load (1 min) | {load():.2f} |")


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (MiB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def distinct(b: Bench, args: argparse.Namespace) -> None:
    spec = b.stream("distinct", P, "quorum")
    log(f"publishing {args.messages:,} messages, each of its own key")
    with Producer(spec, amqp_url=AMQP, window=1000) as producer:
        for start in range(0, args.messages, 1000):
            stop = min(args.messages, start + 1000)
            producer.publish_many((f"u-{i}", b"x" * 100) for i in range(start, stop))
        producer.flush(1200)
    d = Drain(b, spec)
    d.consumer("c1", NOOP_HANDLER, args.concurrency)
    consumer = d.procs[1].pid
    marks: dict[int, float] = {}  # percent handled -> RSS (MiB)

    def sample() -> None:
        done = int(d.handled() * 100 / args.messages)
        for mark in (1, 10, 25, 50, 75, 90):
            if done >= mark and mark not in marks:
                with contextlib.suppress(OSError):
                    marks[mark] = rss_mib(consumer)

    got = d.wait(args.messages, timeout=3600, on_tick=sample)
    print("| handled | RSS (MiB) |\n|---|---|")
    for mark, rss in sorted(marks.items()):
        print(f"| {mark} % | {rss:.1f} |")
    print(
        f"\n{args.messages:,} distinct keys, --concurrency {args.concurrency}, no-op handler: "
        f"{got:.0f} msg/s, load (1 min) {load():.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.concurrency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "scenario", nargs="?", default="rate", choices=("rate", "scale", "noop", "zipf", "keys")
    )
    ap.add_argument("--messages", type=int)
    ap.add_argument("--concurrency")
    ap.add_argument("--handlers", default="sleep_sync,sleep_async")
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline", default="b76c2c9", help="a commit before --concurrency")
    ap.add_argument("--exponent", type=float, default=1.1)
    args = ap.parse_args(argv)
    defaults = {
        "rate": (6000, "1,64"),
        "scale": (12000, "16"),
        "noop": (30000, ""),
        "zipf": (6000, "64"),
        "keys": (1_000_000, "64"),
    }
    messages, concurrency = defaults[args.scenario]
    args.messages = args.messages or messages
    args.concurrency = args.concurrency or concurrency
    if args.scenario in ("zipf", "keys"):
        args.concurrency = int(args.concurrency)
    print(f"{args.scenario}: load average (1 min) at start {load():.2f}", flush=True)
    with LocalEtcd() as etcd:
        b = Bench(etcd, Path(tempfile.mkdtemp(prefix=f"partq-bench-{args.scenario}-")))
        try:
            {"rate": rate, "scale": scale, "noop": noop, "zipf": skew, "keys": distinct}[
                args.scenario
            ](b, args)
        finally:
            b.stop(b.procs)
    print(f"\nload average (1 min) at the end {load():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
