"""``python -m benchmarks.chaos --seed N --duration S``: the randomized fault soak.

See :mod:`benchmarks.chaos`. Exit status 0 if the checker passes (nothing lost, no
unexplained order violation, no overlap), 1 if it does not, 2 if the soak could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from partq.coordinator.leader.policy import standby_mode
from partq.coordinator.ops import admin, groups
from partq.coordinator.store.group import Group
from partq.producer import StreamSpec
from partq.producer.contract import group_scope
from partq.producer.registry import Registry

from partq.kernel.settings import DEFAULT_HANDOFF, Settings
from tests.cluster import EtcdCluster, RabbitCluster
from tests.integration.groups.harness import Fleet, SequenceProducer, balanced, wait_until
from tests.rabbit import MACHINE, TREE_40

from .broker_memory import BrokerSampler, summary
from .nemesis import KINDS, PROCESS_KINDS, Nemesis
from .records import RecordReader
from .report import table
from .sampler import Sampler
from .verdict import IDLE_LIMIT, judge

# Ra's WAL size for the soak's nodes (docs/operations.md, "RabbitMQ memory"): at the
# soak's 1,000 msg/s the broker's default (512 MiB) takes about 15 minutes to fill, and
# until then each node's memory grows with it, hiding any other growth.
WAL_MAX_BYTES = 64 * 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ask = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__)
    ask.add_argument("--seed", type=int, required=True)
    ask.add_argument("--duration", type=float, required=True, help="Seconds of faults.")
    ask.add_argument("--partitions", type=int, default=12)
    ask.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    ask.add_argument("--keys", type=int, default=300)
    ask.add_argument("--rate", type=float, default=1000.0, help="Messages per second.")
    ask.add_argument("--consumers", type=int, default=5, help="At the start (4..6).")
    ask.add_argument("--ttl", type=int, default=5, help="Lease TTL of consumers, coordinators.")
    ask.add_argument("--standby", action=argparse.BooleanOptionalAction, help="Coordinators "
                     "run with --standby (or --no-standby). Default: the product's (a standby "
                     "per partition on quorum queues, none on classic ones).")  # fmt: skip
    ask.add_argument("--balance", choices=["count", "load"], default="count")
    ask.add_argument("--handoff", choices=["drain", "auto"], default=DEFAULT_HANDOFF, help="Every "
                     "consumer's PARTQ_HANDOFF (auto: by consumer priority on RabbitMQ 4 quorum "
                     "queues, the drain elsewhere). Default: the product's.")  # fmt: skip
    ask.add_argument(
        "--faults", default=",".join(KINDS), help=f"Comma-separated subset of {','.join(KINDS)}."
    )
    ask.add_argument("--rabbitmq", choices=["machine", "4.0.5"], default="machine")
    ask.add_argument("--wal-max-bytes", type=int, default=WAL_MAX_BYTES, help="Every node's "
                     "raft.wal_max_size_bytes (0: the broker's default, 512 MiB on 3.10). "
                     "Quorum queues keep what their Ra WAL holds in memory until it reaches "
                     "this and is flushed to segments: 64 MiB makes the broker's memory cycle "
                     "in about 2 minutes, so growth past that is a leak.")  # fmt: skip
    ask.add_argument("--rabbit-conf", action="append", default=[], metavar="KEY=VALUE",
                     help="One more rabbitmq.conf line for every node (repeatable).")  # fmt: skip
    ask.add_argument("--broker-interval", type=float, default=20.0, help="Seconds between "
                     "samples of every RabbitMQ node's own memory breakdown.")  # fmt: skip
    ask.add_argument("--drain-wait", type=float, default=240.0, help="Seconds to wait at the "
                     "end for every confirmed message to be handled.")  # fmt: skip
    ask.add_argument("--idle-limit", type=float, default=IDLE_LIMIT, help="Seconds a partition "
                     "may handle nothing while a message waits in it before the run fails "
                     f"(default {IDLE_LIMIT:.0f}: the worst stall faults explain).")  # fmt: skip
    ask.add_argument("--groups", type=int, default=1, help="Consumer groups reading the "
                     "stream (1..3): the default one, g2, g3, each with two coordinators, its "
                     "own consumers and a nemesis of its processes (the servers' faults are "
                     "shared), each judged on its own.")  # fmt: skip
    ask.add_argument("--out", type=Path, help="Write the results as JSON here.")
    ask.add_argument("--workdir", type=Path, help="Keep logs and records here (kept).")
    args = ask.parse_args(argv)
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ask.error(f"unknown fault kinds {unknown}: choose from {','.join(KINDS)}")
    if not 1 <= args.groups <= 3:
        ask.error("--groups must be 1..3")
    if not 4 <= args.consumers <= 6:
        ask.error("--consumers must be 4..6 (the nemesis scales between 4 and 6)")
    bad = [line for line in args.rabbit_conf if "=" not in line or "\n" in line]
    if bad:
        ask.error(f"--rabbit-conf takes KEY=VALUE, one line: {bad}")
    if not args.idle_limit > 0:
        ask.error("--idle-limit must be above 0 s")
    if args.wal_max_bytes < 0:
        ask.error("--wal-max-bytes must be 0 (the broker's default) or a size in bytes")
    if args.wal_max_bytes:
        args.rabbit_conf = [f"raft.wal_max_size_bytes = {args.wal_max_bytes}", *args.rabbit_conf]
    args.kinds = kinds
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def workdir(given: Path | None) -> Iterator[Path]:
    """``given`` (kept), or a temporary folder removed at the end."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    made = Path(tempfile.mkdtemp(prefix="partq-chaos-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def soak(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Clusters up, group up, load and nemesis for ``args.duration``, heal, wait, judge."""
    install = TREE_40 if args.rabbitmq == "4.0.5" else MACHINE
    with contextlib.ExitStack() as stack:
        log(f"starting 3 RabbitMQ nodes and 3 etcd members under {root}")
        conf = "".join(f"{line}\n" for line in args.rabbit_conf)
        rabbit = stack.enter_context(
            RabbitCluster(root / "rabbit", install=install, extra_config=conf)
        )
        etcd = stack.enter_context(EtcdCluster(root / "etcd"))
        version = rabbit.ctl(rabbit.nodes[0], "version").strip()
        urls = ",".join(rabbit.urls)
        registry = Registry.connect(Settings.load(etcd_endpoints=etcd.endpoints, amqp_url=urls))
        stack.callback(registry.close)
        stream = f"chaos-{args.seed}-{uuid.uuid4().hex[:6]}"
        spec = StreamSpec(stream, args.partitions, args.queue_type)
        admin.create_stream(registry, urls, spec)
        fleet = Fleet(stream, root, etcd.endpoints, urls, root / "records.jsonl")
        fleet.env["PARTQ_HANDOFF"] = args.handoff
        stack.callback(fleet.close)  # every process it started, by PID
        standby = {True: ["--standby"], False: ["--no-standby"], None: []}[args.standby]
        extra = (*standby, "--balance", args.balance)
        for name in ("k1", "k2"):
            fleet.coordinator(name, ttl=args.ttl, settle=1.0, extra=extra)
        nemesis = Nemesis(
            fleet, rabbit, etcd, args.partitions, args.seed, args.kinds, args.ttl, log
        )
        for _ in range(args.consumers):
            nemesis.start_consumer()
        others = [
            _other_group(
                args, stack, stream, registry, urls, etcd.endpoints, rabbit, etcd, root, n, extra
            )
            for n in range(2, args.groups + 1)
        ]
        for fleet_of, nemesis_of in [(fleet, nemesis), *((f, n) for _, f, n in others)]:
            group = Group(registry.client, registry.where, fleet_of.stream)
            wait_until(
                lambda g=group, n=nemesis_of: balanced(g, args.partitions, set(n.consumers)),
                120,
                0.5,
                f"{fleet_of.stream} balanced",
            )

        def processes() -> Iterator[tuple[str, int]]:
            yield "driver+producer", os.getpid()
            for proc in [*fleet.procs, *(p for _, f, _ in others for p in f.procs)]:
                if proc.alive():
                    yield f"consumer {proc.name}" if proc.name[0] == "c" else proc.name, proc.pid
            for member in etcd.members:
                if member.process is not None:
                    yield f"etcd {member.name}", member.process.pid
            for node in rabbit.nodes:
                pid = node.vm_pid() if node.server is not None else None
                if pid is not None:
                    yield f"rabbit {node.name}", pid

        sampler = Sampler(processes)
        sampler.start()
        stack.callback(sampler.stop)
        broker = BrokerSampler(rabbit, args.broker_interval)
        wal_max = broker.wal_max_size_bytes()
        broker.start()
        stack.callback(broker.stop)
        load = SequenceProducer(spec, urls, keys=args.keys, rate=args.rate)
        load.start()
        stack.callback(load.stop)
        wait_until(lambda: len(load.published()) >= args.keys, 60, 0.1, "first confirms")
        began, load_before = time.time(), loadavg()
        log(f"group balanced, load running; nemesis for {args.duration:.0f} s (seed {args.seed})")
        threads = [
            threading.Thread(target=n.run, args=(args.duration,), name=f"nemesis-{name}")
            for name, _, n in others
        ]
        for thread in threads:
            thread.start()
        try:
            nemesis.run(args.duration)
        finally:
            for thread in threads:
                thread.join(args.duration + 60)
            log("healing: SIGCONT, restarts, drain --cancel")
            for each in [nemesis, *(n for _, _, n in others)]:
                each.heal()
        load.stop()
        confirmed = load.published()
        reader = RecordReader(fleet.record)
        readers = {name: RecordReader(f.record) for name, f, _ in others}
        log(f"{len(confirmed)} confirmed; waiting up to {args.drain_wait:.0f} s for every one")
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: all(r.covers(confirmed) for r in [reader, *readers.values()]),
                args.drain_wait,
                2.0,
                "all handled",
            )
        sampler.stop()
        broker.stop()
        verdict = judge(reader.records, confirmed, nemesis.faults, sampler.samples, args.idle_limit)
        group_verdicts = {
            name: judge(
                readers[name].records,
                confirmed,
                [*nemesis.faults, *n.faults],
                sampler.samples,
                args.idle_limit,
            ).as_json()
            for name, _, n in others
        }
        return {
            "seed": args.seed,
            "duration_s": args.duration,
            "command": " ".join(["python -m benchmarks.chaos", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(began)),
            "load_before": load_before,
            "load_after": loadavg(),
            "rabbitmq": version,
            "stream": asdict(spec),
            "keys": args.keys,
            "rate": args.rate,
            "standby": standby_mode(args.standby),
            "balance": args.balance,
            "handoff": args.handoff,
            "idle_limit": args.idle_limit,
            "publish_failures": len(load.failed),
            "publish_failure_examples": load.failed[:1000],
            "fault_log": [asdict(f) for f in nemesis.faults],
            "verdict": verdict.as_json(),
            "groups": group_verdicts,
            "group_faults": {name: [asdict(f) for f in n.faults] for name, _, n in others},
            "rss_samples": [asdict(s) for s in sampler.samples],
            "rabbit_conf": args.rabbit_conf,
            "wal_max_size_bytes": wal_max,
            "broker_memory": summary(broker.samples),
            "broker_samples": [asdict(s) for s in broker.samples],
        }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop by PID on SIGTERM too, as on Ctrl-C
    try:
        with workdir(args.workdir) as root:
            results = soak(args, root)
    except Exception as e:
        log(f"the soak could not run: {type(e).__name__}: {e}")
        return 2
    print(table(results))
    for name, verdict in results["groups"].items():
        print(
            f"group {name}: {'PASS' if verdict['passed'] else 'FAIL'}: "
            f"{len(results['group_faults'][name])} process faults of its own, "
            f"{verdict['handled']} handled, {verdict['lost']} lost, "
            f"{verdict['order_unexplained']} order violations, {verdict['overlaps']} overlaps"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    passed = [results["verdict"]["passed"], *(v["passed"] for v in results["groups"].values())]
    return 0 if all(passed) else 1


def _other_group(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    stream: str,
    registry: Registry,
    urls: str,
    endpoints: str,
    rabbit: RabbitCluster,
    etcd: EtcdCluster,
    root: Path,
    number: int,
    extra: tuple[str, ...],
) -> tuple[str, Fleet, Nemesis]:
    """Group ``g<number>`` of the stream: created, two coordinators, its consumers, and a
    nemesis of its own processes (seeded apart from the first)."""
    name = f"g{number}"
    groups.create_group(registry, urls, stream, name)
    home = root / name
    home.mkdir(exist_ok=True)
    fleet = Fleet(group_scope(stream, name), home, endpoints, urls, home / "records.jsonl")
    fleet.env["PARTQ_HANDOFF"] = args.handoff
    stack.callback(fleet.close)
    for coordinator in ("k1", "k2"):
        fleet.coordinator(coordinator, ttl=args.ttl, settle=1.0, extra=extra)
    kinds = tuple(k for k in args.kinds if k in PROCESS_KINDS)
    nemesis = Nemesis(
        fleet, rabbit, etcd, args.partitions, args.seed + 1000 * number, kinds, args.ttl,
        lambda line: log(f"[{name}] {line}"), prefix=f"{name}c",
    )  # fmt: skip
    for _ in range(args.consumers):
        nemesis.start_consumer()
    return name, fleet, nemesis


if __name__ == "__main__":
    sys.exit(main())
