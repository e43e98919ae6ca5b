# ruff: noqa: E501  (report lines)
"""Per-key order and handoff gap of planned handoffs, driven on two Brokers in one process.

    .venv/bin/python -m benchmarks.handoff_order --runs 10 --messages 30000 --rate 2000 \\
        --mode steady --queue-type quorum

    # against another checkout (e.g. an older commit in a git worktree), by path:
    cd /tmp && PYTHONPATH=/tmp/partq-before /work/main/.venv/bin/python \\
        /work/main/benchmarks/handoff_order.py --queue-type classic

Needs only RabbitMQ (PARTQ_AMQP_URL or --amqp-url, default guest@127.0.0.1:5672); no
etcd. It uses only APIs that partq has had since the drain protocol was introduced
(``partq.consumers.broker.connection.Broker``/``END``/``Delivery``, ``partq.producer.publisher.Producer``,
``partq.producer.contract.StreamSpec``, ``producer.amqp.blocking_connection``/
``declare_stream``/``delete_stream``/``queue_stats``), so the same file measures an
older and a newer tree; it prints which ``consumers/broker/connection.py`` it imported.

Per run, on a fresh stream of P partitions (declared with ``declare_stream``, deleted
at the end):

* a publisher thread (the SDK ``Producer``) sends ``--messages`` keyed messages, body
  ``<key>:<seq>:<n>`` (n = publish number), round-robin over ``--keys`` keys chosen so that every partition gets
  the same number of keys (±1), ``steady`` (evenly paced at ``--rate``) or ``bursty``
  (``--burst`` messages back to back, then a pause, same average rate); it keeps the set
  of confirmed (key, seq);
* two ``Broker`` instances A and B (one connection each) whose deliver callbacks record
  (time, partition, key, seq, n, redelivered, consumer), ack at once, and on END call
  ``broker.finish`` (what the worker does); half the partitions start on each;
* a driver moves every partition back and forth, staggered: partition p is moved once
  ``--period`` seconds have passed since its last move began (phase p·period/P) and it
  has been subscribed at its owner for ``--min-dwell`` seconds: ``cancel(p)`` on the
  owner, then, in ``Drained(p)``, ``subscribe(p)`` on the other. Moves continue until
  the publisher is done and every partition was moved ``--min-handoffs`` times;
* a final drain waits until every confirmed (key, seq) was handled.

Reported per run and pooled over runs:

* order violations: a (key, seq) handled for the first time after a higher seq of the
  same key; a second handling of an already handled (key, seq) is a *duplicate*,
  counted apart; *redeliveries* = deliveries flagged ``redelivered`` by the broker;
  *partition inversions*: the same over the publish number within a partition (one
  publisher channel, so that is the queue's order): it shows any message that came back
  behind a newer one, even when no newer message *of its key* was in the queue;
* lost = confirmed - handled, after the final drain (must be 0);
* handoff gap, for moves where messages of the partition were waiting when the old owner
  reported it drained (published, i.e. handed to the Producer, but not yet handled; so
  moves of an idle partition, e.g. after the last publish or in a pause between bursts,
  are left out): ``cancel(p)`` called → first delivery of p at the new owner, and its part
  after ``Drained`` (``subscribe(p)`` → first delivery); p50/p99 (nearest rank) over
  all such moves. The drain time (``cancel`` → ``Drained``) is reported for every move.
  Because the old owner keeps handling deliveries while it holds its acks, the gap is not
  a pause in handling; *stall* is: the later of ``cancel(p)`` and the old owner's last
  delivery of p → the new owner's first (same moves).

``--handoff priority`` (RabbitMQ 4 quorum queues; ``consumers/state/priority.py``) moves a
partition without a drain: the new owner subscribes with ``x-priority`` one above the old
owner's (a per-partition counter, which etcd would keep), the old owner acks on as usual,
the broker switches once it has settled everything, and the new owner's first delivery
cuts the old owner's consumer (``Broker.cut``: it is waiting, nothing comes back).

``--cancel immediate`` monkeypatches ``partq.consumers.state.window.Window.full`` to be True (the drain
then sends ``basic.cancel`` at once, without holding for a full window or a quiet spell), to see whether the hold is still needed once returns go to the head.

Every wait is bounded (``--max-seconds`` per run for the moves, ``--drain-timeout`` for
the final drain). Not a test: it asserts nothing; ``--json`` appends one JSON line per run
and one for the summary.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from partq.consumers.broker import connection as broker_module
from partq.consumers.broker.connection import Broker
from partq.consumers.broker.port import BrokerEvent, ChannelLost, Delivery, Drained, End, Subscribed
from partq.consumers.state import window as window_module
from partq.producer.contract import StreamSpec
from partq.producer.publisher import Producer
from partq.producer.queue_probes import queue_stats
from partq.producer.topology import declare_stream, delete_stream

from partq.kernel.amqp import blocking_connection

AMQP = os.environ.get("PARTQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
CONSUMERS = ("A", "B")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms"


# -- the code under test ------------------------------------------------------------------


def tree_info() -> dict[str, Any]:
    """Which partq files this process imported, and a digest of the ones that matter here."""
    root = Path(broker_module.__file__).resolve().parent.parent
    digests = {}
    for rel in (
        "consumers/broker/connection.py",
        "consumers/broker/channels.py",
        "consumers/broker/drain.py",
        "consumers/broker/hotstandby.py",
        "consumers/broker/slots.py",
        "consumers/state/window.py",
        "producer/amqp.py",
        "producer/contract.py",
        "producer/publisher.py",
    ):
        path = root / rel
        digests[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else None
    head = None
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: …"
            git = Path(git.read_text().split(":", 1)[1].strip())
        ref = (git / "HEAD").read_text().strip()
        if ref.startswith("ref:"):
            ref_path = ref.split(" ", 1)[1]
            candidates = [git / ref_path]
            commondir = git / "commondir"
            if commondir.exists():
                candidates.append((git / commondir.read_text().strip()) / ref_path)
            for candidate in candidates:
                if candidate.exists():
                    head = candidate.read_text().strip()
                    break
        else:
            head = ref
    except OSError:
        pass
    return {
        "root": str(root),
        "head": head,
        "drain": "window-full",
        "sha256": digests,
    }


def patch_cancel_immediate() -> None:
    """Every drain's window counts as full: ``basic.cancel`` goes at once."""
    window_module.Window.full = property(lambda self: True)  # type: ignore[method-assign,assignment]


class _WarningCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "cancelling after" in text:
            self.messages["forced cancel (max hold)"] += 1
        elif "channel closed" in text:
            self.messages["channel closed"] += 1
        else:
            self.messages[text[:80]] += 1


# -- one run ------------------------------------------------------------------------------


def balanced_keys(count: int, partitions: int) -> list[str]:
    """``count`` keys, taken one partition after the other: every partition gets count/P (±1).

    Publishing round-robin over this list spreads the rate evenly over the partitions.
    """
    spec = StreamSpec("keys", partitions, "classic")
    per: list[list[str]] = [[] for _ in range(partitions)]
    need = math.ceil(count / partitions)
    i = 0
    while min(len(keys) for keys in per) < need:
        key = f"key-{i}"
        i += 1
        per[spec.partition_for(key)].append(key)
    return [per[p][r] for r in range(need) for p in range(partitions)][:count]


@dataclass
class Move:
    partition: int
    old: str
    new: str
    cancel_t: float
    drained_t: float | None = None
    waiting: bool | None = None  # messages of the partition were in its queue at on_drained
    last_old_t: float | None = None  # the old owner's last delivery of the partition
    subscribed_t: float | None = None  # the new owner's on_subscribed
    first_t: float | None = None  # first delivery of the partition at the new owner


@dataclass
class RunState:
    spec: StreamSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: list[tuple[float, int, str, int, int, bool, str]] = field(default_factory=list)
    handled: set[tuple[str, int]] = field(default_factory=set)
    confirmed: set[tuple[str, int]] = field(default_factory=set)
    published: int = 0
    publish_failed: int = 0
    publish_error: BaseException | None = None
    publish_started: float = 0.0
    publish_ended: float = 0.0
    publisher_done: threading.Event = field(default_factory=threading.Event)
    published_per_p: list[int] = field(default_factory=list)
    last_delivery: list[float] = field(default_factory=list)
    handled_per_p: list[int] = field(default_factory=list)
    owner: list[str] = field(default_factory=list)
    moving: list[bool] = field(default_factory=list)
    subscribed: list[threading.Event] = field(default_factory=list)
    subscribed_at: list[float] = field(default_factory=list)
    next_move: list[float] = field(default_factory=list)
    current: list[Move | None] = field(default_factory=list)
    priority: list[int] = field(default_factory=list)  # --handoff priority: etcd's counter
    moves: list[Move] = field(default_factory=list)
    foreign: int = 0  # deliveries at a consumer that did not own the partition
    channel_lost: list[tuple[str, int]] = field(default_factory=list)
    stopping: bool = False  # the brokers are being stopped: their channels go with them

    def __post_init__(self) -> None:
        n = self.spec.partitions
        self.published_per_p = [0] * n
        self.last_delivery = [0.0] * n
        self.handled_per_p = [0] * n
        self.owner = [CONSUMERS[p % 2] for p in range(n)]
        self.moving = [False] * n
        self.subscribed = [threading.Event() for _ in range(n)]
        self.subscribed_at = [0.0] * n
        self.next_move = [0.0] * n
        self.current = [None] * n
        self.priority = [0] * n


def publisher(state: RunState, args: argparse.Namespace, keys: list[str], url: str) -> None:
    spec = state.spec
    partition_of = {key: spec.partition_for(key) for key in keys}

    def confirmed(future: Any, key: str, seq: int) -> None:
        if future.exception() is None:
            state.confirmed.add((key, seq))
        else:
            state.publish_failed += 1

    try:
        with Producer(spec, amqp_url=url, name="handoff-publisher") as producer:
            start = time.monotonic()
            state.publish_started = start
            deadline = start + args.messages / args.rate * 3 + 30
            n_keys = len(keys)
            i = 0
            burst_period = args.burst / args.rate
            while i < args.messages and time.monotonic() < deadline:
                now = time.monotonic()
                if args.mode == "steady":
                    target = min(args.messages, int((now - start) * args.rate) + 1)
                else:
                    burst = int((now - start) / burst_period)
                    target = min(args.messages, (burst + 1) * args.burst)
                if i >= target:
                    wake = (
                        start + target / args.rate
                        if args.mode == "steady"
                        else start + (target // args.burst) * burst_period
                    )
                    time.sleep(max(0.0005, min(0.05, wake - now)))
                    continue
                while i < target:
                    key = keys[i % n_keys]
                    seq = i // n_keys
                    state.published_per_p[partition_of[key]] += 1  # only this thread writes it
                    future = producer.publish(key, f"{key}:{seq}:{i}")
                    future.add_done_callback(lambda f, k=key, s=seq: confirmed(f, k, s))
                    i += 1
                    state.published = i
            state.publish_ended = time.monotonic()
            producer.flush(60)
    except BaseException as e:
        state.publish_error = e
        raise
    finally:
        state.publisher_done.set()


def run_once(args: argparse.Namespace, index: int, url: str) -> dict[str, Any]:
    spec = StreamSpec(f"bench-handoff-{uuid.uuid4().hex[:10]}", args.partitions, args.queue_type)
    keys = balanced_keys(args.keys, args.partitions)
    state = RunState(spec)
    load_start = loadavg()
    wall_start = dt.datetime.now(dt.UTC)
    with blocking_connection(url, name="handoff-admin") as connection:
        declare_stream(connection, spec)
    brokers: dict[str, Broker] = {}
    generations = itertools.count(1)  # one per subscribe (no worker routing here)
    warnings = _WarningCounter()
    logging.getLogger("partq.consumer.broker").addHandler(warnings)
    try:
        by_priority = args.handoff == "priority"

        def subscribe(name: str, partition: int) -> None:
            """Subscribe with the partition's priority only by priority (so that this file
            still drives a tree whose ``subscribe`` takes none)."""
            if by_priority:
                brokers[name].subscribe(
                    partition, next(generations), priority=state.priority[partition]
                )
            else:
                brokers[name].subscribe(partition, next(generations))

        def make(name: str) -> Broker:
            other = CONSUMERS[1 - CONSUMERS.index(name)]

            def deliver(item: Delivery) -> None:  # this broker's I/O thread
                partition = item.partition
                now = time.monotonic()
                key, seq_text, n_text = item.body.decode().split(":")
                seq = int(seq_text)
                state.records.append(
                    (now, partition, key, seq, int(n_text), bool(item.redelivered), name)
                )
                if (key, seq) not in state.handled:
                    state.handled.add((key, seq))
                    state.handled_per_p[partition] += 1
                move = state.current[partition]
                if move is not None and move.new == name and move.first_t is None:
                    move.first_t = now
                    if by_priority:  # the broker switched: the old owner settled everything
                        move.last_old_t = state.last_delivery[partition]
                        state.owner[partition] = name
                        brokers[move.old].cut(partition)  # waiting now: nothing comes back
                if state.owner[partition] != name:
                    state.foreign += 1
                state.last_delivery[partition] = now
                brokers[name].ack(partition, item.channel, item.delivery_tag)

            def on_subscribed(partition: int) -> None:
                now = time.monotonic()
                with state.lock:
                    move = state.current[partition]
                    if by_priority and move is not None and move.subscribed_t is None:
                        move.subscribed_t = now  # the move ends when the old one is cut
                        move.waiting = (
                            state.published_per_p[partition] > state.handled_per_p[partition]
                        )
                        return
                    if move is not None and move.subscribed_t is None:
                        move.subscribed_t = now
                        state.next_move[partition] = max(
                            move.cancel_t + args.period, now + args.min_dwell
                        )
                    state.subscribed_at[partition] = now
                    state.moving[partition] = False
                state.subscribed[partition].set()

            def on_drained(partition: int) -> None:
                now = time.monotonic()
                with state.lock:
                    move = state.current[partition]
                    if move is None or move.old != name or move.drained_t is not None:
                        return
                    move.drained_t = now
                    if by_priority:  # cut after the switch: the heir consumes already
                        state.next_move[partition] = max(
                            move.cancel_t + args.period, now + args.min_dwell
                        )
                        state.moving[partition] = False
                        return
                    move.last_old_t = state.last_delivery[partition]
                    # published but not yet handled: the new owner has something to do at once
                    move.waiting = state.published_per_p[partition] > state.handled_per_p[partition]
                    state.owner[partition] = other
                subscribe(other, partition)

            def on_channel_lost(partition: int) -> None:
                if state.stopping:
                    return
                state.channel_lost.append((name, partition))
                with state.lock:
                    move = state.current[partition]
                    if move is not None and move.old == name and move.drained_t is None:
                        move.drained_t = time.monotonic()
                        move.waiting = None  # not a clean drain: kept out of the gap figures
                        state.owner[partition] = other
                        target = other
                    else:
                        target = state.owner[partition]
                subscribe(target, partition)

            def sink(event: BrokerEvent) -> None:
                match event:
                    case Delivery():
                        deliver(event)
                    case End(partition, channel):
                        brokers[name].finish(partition, channel)
                    case Subscribed(partition):
                        on_subscribed(partition)
                    case Drained(partition):
                        on_drained(partition)
                    case ChannelLost(partition):
                        on_channel_lost(partition)

            return Broker(
                url, spec, prefetch=args.prefetch, heartbeat=10, name=f"handoff-{name}",
                sink=sink,
            )  # fmt: skip

        for name in CONSUMERS:
            brokers[name] = make(name)
            brokers[name].start()
        for name in CONSUMERS:
            if not brokers[name].connected.wait(15):
                raise RuntimeError(f"consumer {name} did not connect")
        for p in range(spec.partitions):
            subscribe(state.owner[p], p)
        for p in range(spec.partitions):
            if not state.subscribed[p].wait(15):
                raise RuntimeError(f"partition {p} was not subscribed")
        t0 = time.monotonic()
        for p in range(spec.partitions):
            state.next_move[p] = t0 + args.min_dwell + p * args.period / spec.partitions

        pub = threading.Thread(
            target=publisher, args=(state, args, keys, url), name="publisher", daemon=True
        )
        pub.start()
        deadline = t0 + args.max_seconds
        handoffs = [0] * spec.partitions
        while time.monotonic() < deadline:
            now = time.monotonic()
            done = state.publisher_done.is_set()
            if done and min(handoffs) >= args.min_handoffs:
                break
            to_cancel: list[tuple[str, int]] = []
            with state.lock:
                for p in range(spec.partitions):
                    if state.moving[p] or now < state.next_move[p]:
                        continue
                    if done and handoffs[p] >= args.min_handoffs:
                        continue
                    old = state.owner[p]
                    move = Move(p, old, CONSUMERS[1 - CONSUMERS.index(old)], cancel_t=now)
                    state.current[p] = move
                    state.moves.append(move)
                    state.moving[p] = True
                    handoffs[p] += 1
                    to_cancel.append((old, p))
            for old, p in to_cancel:  # outside the lock: a failed cancel calls on_channel_lost
                if by_priority:  # the heir outranks the owner: the broker switches to it
                    state.priority[p] += 1
                    subscribe(CONSUMERS[1 - CONSUMERS.index(old)], p)
                else:
                    brokers[old].cancel(p)
            time.sleep(0.005)
        stopped_moving = time.monotonic()
        while any(state.moving) and time.monotonic() < stopped_moving + 30:
            time.sleep(0.01)  # moves in flight finish
        pub.join(timeout=max(1.0, deadline - time.monotonic()) + 60)
        if state.publish_error is not None:
            raise RuntimeError(f"the publisher failed: {state.publish_error!r}")
        drain_deadline = time.monotonic() + args.drain_timeout
        while time.monotonic() < drain_deadline and not state.confirmed <= state.handled:
            time.sleep(0.1)
        time.sleep(0.3)  # late duplicates, if any
        with blocking_connection(url, name="handoff-admin") as connection:
            left = sum(s.messages or 0 for s in queue_stats(connection, spec))
    finally:
        state.stopping = True
        for b in brokers.values():
            b.stop()
        for b in brokers.values():
            b.join(10)
        logging.getLogger("partq.consumer.broker").removeHandler(warnings)
        try:
            with blocking_connection(url, name="handoff-admin") as connection:
                delete_stream(connection, spec)
        except Exception as e:  # the run's figures are still worth reporting
            log(f"could not delete stream {spec.name}: {e!r}")

    result = analyse(state, args)
    result.update(
        run=index,
        stream=spec.name,
        started=wall_start.isoformat(timespec="seconds"),
        load_start=load_start,
        load_end=loadavg(),
        left_in_queues=left,
        publish_rate=(
            state.published / (state.publish_ended - state.publish_started)
            if state.publish_ended > state.publish_started
            else None
        ),
        publish_failed=state.publish_failed,
        foreign=state.foreign,
        channel_lost=len(state.channel_lost),
        broker_warnings=dict(warnings.messages),
        min_handoffs_per_partition=min(
            Counter(m.partition for m in state.moves).values(), default=0
        ),
        stuck_moves=sum(1 for m in state.moves if m.subscribed_t is None),
    )
    return result


def analyse(state: RunState, args: argparse.Namespace) -> dict[str, Any]:
    high: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    violations = duplicates = redelivered = inversions = 0
    violating_keys: set[str] = set()
    high_n: dict[int, int] = {}
    examples: list[int] = []
    for index, (_t, p, key, seq, n, was_redelivered, _c) in enumerate(state.records):
        if was_redelivered:
            redelivered += 1
        if (key, seq) in seen:
            duplicates += 1
            continue
        seen.add((key, seq))
        if n < high_n.get(p, -1):
            inversions += 1
            if len(examples) < args.dump_inversions:
                examples.append(index)
        else:
            high_n[p] = n
        if seq < high.get(key, -1):
            violations += 1
            violating_keys.add(key)
        else:
            high[key] = seq
    if examples:
        dump_inversions(state, examples)
    # consecutive redelivered deliveries of one partition: what one handoff gave back
    batches: list[tuple[int, bool]] = []  # (size, served in publish order)
    open_batches: dict[int, list[int]] = {}
    for _t, p, _key, _seq, n, was_redelivered, _c in state.records:
        if was_redelivered:
            open_batches.setdefault(p, []).append(n)
        elif p in open_batches:
            ns = open_batches.pop(p)
            batches.append((len(ns), ns == sorted(ns)))
    batches.extend((len(ns), ns == sorted(ns)) for ns in open_batches.values())
    clean = [m for m in state.moves if m.waiting and m.first_t is not None and m.drained_t]
    return {
        "messages": len(state.confirmed),
        "published": state.published,
        "deliveries": len(state.records),
        "handled": len(seen),
        "handoffs": len(state.moves),
        "violations": violations,
        "violating_keys": len(violating_keys),
        "inversions": inversions,
        "duplicates": duplicates,
        "redelivered": redelivered,
        "lost": len(state.confirmed - seen),
        "unconfirmed_handled": len(seen - state.confirmed),
        "gap_moves": len(clean),
        "gap": [m.first_t - m.cancel_t for m in clean],  # type: ignore[operator]
        "gap_after_drained": [m.first_t - m.drained_t for m in clean],  # type: ignore[operator]
        "stall": [m.first_t - max(m.cancel_t, m.last_old_t or 0.0) for m in clean],  # type: ignore[operator]
        "return_batches": batches,
        "drain": [m.drained_t - m.cancel_t for m in state.moves if m.drained_t is not None],
    }


def dump_inversions(state: RunState, examples: list[int]) -> None:
    """Print each inversion with its partition's deliveries around it and the nearby moves."""
    t0 = state.records[0][0] if state.records else 0.0
    for index in examples:
        t, p, key, seq, n, redelivered, consumer = state.records[index]
        print(
            f"--- inversion: partition {p} {key}:{seq} n={n} redelivered={redelivered} at {consumer} t={t - t0:.3f}s"
        )
        around = [(i, r) for i, r in enumerate(state.records) if r[1] == p and abs(r[0] - t) < 1.0]
        lines = [i for i, _ in around]
        here = lines.index(index)
        for i, r in around[max(0, here - 25) : here + 10]:
            mark = "=>" if i == index else "  "
            print(
                f"   {mark} t={r[0] - t0:8.3f} {r[6]} n={r[4]:6d} {r[2]}:{r[3]} redelivered={r[5]}"
            )
        for m in state.moves:
            if m.partition == p and abs(m.cancel_t - t) < 1.5:
                rel = lambda x: "-" if x is None else f"{x - t0:.3f}"  # noqa: E731
                print(
                    f"   move {m.old}->{m.new}: cancel {rel(m.cancel_t)} drained {rel(m.drained_t)} "
                    f"old's last {rel(m.last_old_t)} subscribed {rel(m.subscribed_t)} first {rel(m.first_t)}"
                )


# -- reporting ----------------------------------------------------------------------------


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    def total(k: str) -> int:
        return sum(r[k] for r in results)

    gap = [g for r in results for g in r["gap"]]
    after = [g for r in results for g in r["gap_after_drained"]]
    drain = [g for r in results for g in r["drain"]]
    stall = [g for r in results for g in r["stall"]]
    batches = [tuple(b) for r in results for b in r["return_batches"]]
    ordered = [size for size, in_order in batches if in_order]
    scrambled = [size for size, in_order in batches if not in_order]
    return {
        "runs": len(results),
        **{
            k: total(k)
            for k in (
                "messages",
                "handoffs",
                "violations",
                "inversions",
                "duplicates",
                "redelivered",
                "lost",
                "gap_moves",
                "foreign",
                "channel_lost",
                "stuck_moves",
                "left_in_queues",
                "unconfirmed_handled",
                "publish_failed",
            )
        },
        "violations_per_run": [r["violations"] for r in results],
        "redelivered_per_run": [r["redelivered"] for r in results],
        "runs_with_violations": sum(1 for r in results if r["violations"]),
        "gap_p50": percentile(gap, 50),
        "gap_p99": percentile(gap, 99),
        "gap_after_drained_p50": percentile(after, 50),
        "gap_after_drained_p99": percentile(after, 99),
        "return_batches": len(batches),
        "return_batches_out_of_order": len(scrambled),
        "return_batch_max_in_order": max(ordered, default=0),
        "return_batch_min_out_of_order": min(scrambled, default=None),
        "return_batch_sizes": {
            f"{size}{'' if in_order else '*'}": count
            for (size, in_order), count in sorted(Counter(batches).items())
        },
        "stall_p50": percentile(stall, 50),
        "stall_p99": percentile(stall, 99),
        "drain_p50": percentile(drain, 50),
        "drain_p99": percentile(drain, 99),
        "publish_rate_min": min((r["publish_rate"] or 0) for r in results) if results else None,
        "min_handoffs_per_partition": min(
            (r["min_handoffs_per_partition"] for r in results), default=0
        ),
        "broker_warnings": dict(sum((Counter(r["broker_warnings"]) for r in results), Counter())),
        "load_start": results[0]["load_start"] if results else None,
        "load_end": results[-1]["load_end"] if results else None,
    }


def table_row(label: str, s: dict[str, Any]) -> str:
    return (
        f"| {label} | {s['runs']} | {s['messages']:,} | {s['handoffs']:,} | "
        f"{s['violations']} ({s['runs_with_violations']}/{s['runs']} runs) | {s['inversions']} | "
        f"{s['redelivered']} | "
        f"{s['duplicates']} | {s['lost']} | {ms(s['gap_p50'])} / {ms(s['gap_p99'])} | "
        f"{ms(s['gap_after_drained_p50'])} / {ms(s['gap_after_drained_p99'])} | "
        f"{ms(s['stall_p50'])} / {ms(s['stall_p99'])} | {ms(s['drain_p50'])} / {ms(s['drain_p99'])} |"
    )


TABLE_HEADER = (
    "| config | runs | messages | handoffs | order violations | partition inversions | redelivered | duplicates | lost "
    "| gap cancel→first p50 / p99 | of which after on_drained p50 / p99 | stall p50 / p99 | drain cancel→on_drained p50 / p99 |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks.handoff_order",
        description="Per-key order violations and handoff gaps of planned handoffs "
        "(two Brokers in one process, moving every partition back and forth).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--messages", type=int, default=30_000, help="messages per run")
    parser.add_argument("--rate", type=float, default=2000.0, help="average publish rate, msg/s")
    parser.add_argument("--mode", choices=("steady", "bursty"), default="steady")
    parser.add_argument("--burst", type=int, default=1000, help="bursty: messages per burst")
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")
    parser.add_argument("--cancel", choices=("as-is", "immediate"), default="as-is",
                        help="immediate: patch Window.full to be True (drain cancels at once)")  # fmt: skip
    parser.add_argument("--handoff", choices=("drain", "priority"), default="drain",
                        help="priority: the heir subscribes with x-priority above the owner's and "
                        "the broker switches (RabbitMQ 4 quorum; consumers/state/priority.py)")  # fmt: skip
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--prefetch", type=int, default=100)
    parser.add_argument("--period", type=float, default=1.0,
                        help="seconds between the starts of two moves of one partition")  # fmt: skip
    parser.add_argument("--min-dwell", type=float, default=0.1,
                        help="seconds a partition stays subscribed at its new owner before it moves again")  # fmt: skip
    parser.add_argument("--min-handoffs", type=int, default=10, help="per partition per run")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="bound on one run's publish-and-move phase")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    parser.add_argument("--amqp-url", default=AMQP)
    parser.add_argument("--label", default=None, help="label of the table row")
    parser.add_argument("--dump-inversions", type=int, default=0,
                        help="print up to N partition inversions per run with their context")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.messages < 1 or args.rate <= 0 or args.burst < 1:
        parser.error("--runs, --messages, --rate and --burst must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    if args.cancel == "immediate":
        patch_cancel_immediate()
    tree = tree_info()
    label = args.label or (
        f"{args.queue_type} {args.mode} {args.handoff}"
        + (" cancel=immediate" if args.cancel == "immediate" else "")
    )
    command = " ".join([Path(sys.executable).name, *sys.argv])
    log(
        f"{label}: tree {tree['root']} head {tree['head']} drain={tree['drain']} files {tree['sha256']}"
    )
    log(f"python {platform.python_version()}, pika {pika.__version__}, load {loadavg()}")
    header = {
        "kind": "config", "label": label, "command": command, "argv": sys.argv[1:],
        "pythonpath": os.environ.get("PYTHONPATH"), "tree": tree,
        "python": platform.python_version(), "pika": pika.__version__,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "load_start": loadavg(),
    }  # fmt: skip
    results: list[dict[str, Any]] = []
    for index in range(args.runs):
        result = run_once(args, index, args.amqp_url)
        results.append(result)
        log(
            f"run {index + 1}/{args.runs}: {result['messages']} msgs at "
            f"{(result['publish_rate'] or 0):,.0f} msg/s, {result['handoffs']} handoffs "
            f"(min/partition {result['min_handoffs_per_partition']}), violations "
            f"{result['violations']} ({result['violating_keys']} keys), partition inversions "
            f"{result['inversions']}, redelivered "
            f"{result['redelivered']}, duplicates {result['duplicates']}, lost {result['lost']}, "
            f"gap p50 {ms(percentile(result['gap'], 50))} p99 {ms(percentile(result['gap'], 99))} "
            f"({result['gap_moves']} moves with waiting messages), stall p50 "
            f"{ms(percentile(result['stall'], 50))} p99 {ms(percentile(result['stall'], 99))}, drain p50 "
            f"{ms(percentile(result['drain'], 50))}, foreign {result['foreign']}, "
            f"lost channels {result['channel_lost']}, left {result['left_in_queues']}, "
            f"warnings {result['broker_warnings']}, load {result['load_start']} -> {result['load_end']}"
        )
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"kind": "run", "label": label, **result}) + "\n")
    summary = summarise(results)
    summary["load_end"] = loadavg()
    print(TABLE_HEADER)
    print(table_row(label, summary))
    print(
        f"violations per run {summary['violations_per_run']}, redelivered per run "
        f"{summary['redelivered_per_run']}, min publish rate {summary['publish_rate_min']:,.0f} msg/s, "
        f"min handoffs/partition/run {summary['min_handoffs_per_partition']}, gap moves "
        f"{summary['gap_moves']}, return batches {summary['return_batches']} (out of order "
        f"{summary['return_batches_out_of_order']}, largest in order "
        f"{summary['return_batch_max_in_order']}, smallest out of order "
        f"{summary['return_batch_min_out_of_order']}; sizes {summary['return_batch_sizes']}), "
        f"foreign {summary['foreign']}, lost channels "
        f"{summary['channel_lost']}, stuck moves {summary['stuck_moves']}, left in queues "
        f"{summary['left_in_queues']}, broker warnings {summary['broker_warnings']}, load "
        f"{header['load_start']} -> {summary['load_end']}",
        flush=True,
    )
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(header) + "\n")
            f.write(json.dumps({"kind": "summary", "label": label, **summary}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
