"""The seeded nemesis: one fault every 5-15 s, drawn with ``random.Random(seed)``.

Each fault is recorded as a :class:`~benchmarks.chaos.verdict.Fault` (wall-clock time,
kind, target, the pid it hit). What a fault undoes later (SIGCONT of a frozen consumer, the
restart of a killed etcd member or RabbitMQ node, ``drain --cancel``) waits in a list of
pending repairs run when due, so faults overlap as they would in production; :meth:`heal`
runs every pending repair at once. Only the nemesis's thread touches its state.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.cluster import EtcdCluster, RabbitCluster
from tests.integration.groups.harness import Fleet, Proc

from .verdict import BROKER_CRASH, CONSUMER_CRASH, FREEZE, Fault

__all__ = ["KINDS", "PROCESS_KINDS", "Nemesis"]

KINDS = (
    CONSUMER_CRASH,  # kill -9, restarted under the same member id (a StatefulSet's pod)
    "consumer-term",  # SIGTERM, restarted under the same member id
    FREEZE,  # SIGSTOP for 2-12 s, then SIGCONT
    "etcd-kill",  # kill -9 of a member that is not the leader, restarted 5-15 s later
    "etcd-leader-kill",
    BROKER_CRASH,  # kill -9 of a RabbitMQ node's VM, restarted 5-15 s later
    "move",  # partq move of a random partition to a random member
    "rebalance",
    "drain",  # partq drain of a member, --cancel 10-30 s later
    "scale-up",  # one more consumer (at most MAX_CONSUMERS)
    "scale-down",  # SIGTERM of one, not replaced (at least MIN_CONSUMERS)
)
# what another group's nemesis fires: its own processes and operations (the servers are
# the first nemesis's, shared by every group)
PROCESS_KINDS = tuple(k for k in KINDS if k not in ("etcd-kill", "etcd-leader-kill", BROKER_CRASH))
MIN_CONSUMERS, MAX_CONSUMERS = 4, 6
CLI = [sys.executable, "-m", "partq"]


@dataclass(order=True)
class _Repair:
    due: float
    what: str = field(compare=False)
    run: Callable[[], object] = field(compare=False)  # its result is ignored


@dataclass
class Nemesis:
    fleet: Fleet
    rabbit: RabbitCluster
    etcd: EtcdCluster
    partitions: int
    seed: int
    kinds: tuple[str, ...] = KINDS
    ttl: int = 5
    log: Callable[[str], None] = print
    faults: list[Fault] = field(default_factory=list)
    consumers: dict[str, Proc] = field(default_factory=dict)  # member id -> its process
    frozen: set[str] = field(default_factory=set)
    draining: str | None = None
    _repairs: list[_Repair] = field(default_factory=list)
    _deck: list[str] = field(default_factory=list)  # kinds not yet fired this round
    _next_member: int = 1
    prefix: str = "c"  # member ids: c1, c2, ... (another group's nemesis: its own prefix)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # -- the fleet ----------------------------------------------------------------------

    def start_consumer(self, member: str | None = None) -> Proc:
        if member is None:
            member, self._next_member = f"{self.prefix}{self._next_member}", self._next_member + 1
        proc = self.fleet.consumer(member, ttl=self.ttl)
        self.consumers[member] = proc
        return proc

    def _targets(self) -> list[str]:
        """Consumers a fault may hit: running and not frozen, in sorted order."""
        return sorted(m for m, p in self.consumers.items() if p.alive() and m not in self.frozen)

    def cli(self, *args: str) -> tuple[bool, str]:
        env = self.fleet._env()
        try:
            done = subprocess.run(
                [*CLI, *args], env=env, capture_output=True, text=True, timeout=60, check=False,
                cwd=env["PYTHONPATH"],
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False, f"partq {' '.join(args)}: no answer in 60 s"
        out = (done.stdout + done.stderr).strip().splitlines()
        return done.returncode == 0, f"rc {done.returncode}: {out[-1] if out else ''}"

    # -- the loop -----------------------------------------------------------------------

    def run(self, duration: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Fire faults for ``duration`` seconds (or until ``stop()``), repairs as they fall due."""
        end = time.monotonic() + duration
        next_fault = time.monotonic() + self.rng.uniform(5, 15)
        for _ in range(int(duration * 4) + 10):  # one pass per 0.25 s at most
            now = time.monotonic()
            if now >= end or stop():
                return
            self._run_due(now)
            if now >= next_fault:
                self.fire()
                next_fault = time.monotonic() + self.rng.uniform(5, 15)
            wake = min([next_fault, end, *(r.due for r in self._repairs)])
            time.sleep(min(max(0.0, wake - time.monotonic()), 0.25))

    def _run_due(self, now: float) -> None:
        self._repairs.sort()
        for _ in range(len(self._repairs)):
            if not self._repairs or self._repairs[0].due > now:
                return
            repair = self._repairs.pop(0)
            try:
                repair.run()
                self.log(f"repaired: {repair.what}")
            except Exception as e:  # a failed repair is reported; heal tries the rest
                self.log(f"repair failed: {repair.what}: {e}")

    def heal(self) -> None:
        """Every pending repair now: nothing frozen, every server back, no drain left."""
        self._run_due(float("inf"))

    def fire(self) -> None:
        """The next fault of a shuffled deck of every kind that applies now: a short run
        still sees each kind once, in an order the seed decides."""
        if not self._deck:
            self._deck = self.rng.sample(self.kinds, len(self.kinds))
        kind = next((k for k in self._deck if self._applies(k)), None)
        if kind is None:
            return
        self._deck.remove(kind)
        fault = getattr(self, "_" + kind.replace("-", "_"))()
        self.faults.append(fault)
        self.log(f"fault {kind} {fault.target} pid={fault.pid} ok={fault.ok} {fault.detail}")

    def _applies(self, kind: str) -> bool:
        targets = self._targets()
        if kind in (CONSUMER_CRASH, "consumer-term", FREEZE, "move"):
            return bool(targets)
        if kind in ("etcd-kill", "etcd-leader-kill"):
            return all(m.process is not None for m in self.etcd.members)
        if kind == BROKER_CRASH:
            return all(n.server is not None for n in self.rabbit.nodes)
        if kind == "drain":
            return self.draining is None and len(targets) >= 2
        if kind == "scale-up":
            return len([p for p in self.consumers.values() if p.alive()]) < MAX_CONSUMERS
        if kind == "scale-down":
            return len([p for p in self.consumers.values() if p.alive()]) > MIN_CONSUMERS
        return kind == "rebalance"

    def _later(self, low: float, high: float, what: str, run: Callable[[], object]) -> None:
        self._repairs.append(_Repair(time.monotonic() + self.rng.uniform(low, high), what, run))

    # -- the faults ---------------------------------------------------------------------

    def _consumer_kill(self) -> Fault:
        member = self.rng.choice(self._targets())
        proc = self.consumers[member]
        at = time.time()
        proc.kill()
        self.start_consumer(member)
        return Fault(at, CONSUMER_CRASH, member, proc.pid)

    def _stop_gracefully(self, kind: str, restart: bool) -> Fault:
        member = self.rng.choice(self._targets())
        proc = self.consumers[member]
        at = time.time()
        code = proc.terminate(timeout=40)
        if restart:
            self.start_consumer(member)
        else:
            del self.consumers[member]
        ok_exit = code == 0
        return Fault(at, kind, member, proc.pid, detail=f"exit {code}" + ("" if ok_exit else " !"))

    def _consumer_term(self) -> Fault:
        return self._stop_gracefully("consumer-term", restart=True)

    def _scale_down(self) -> Fault:
        return self._stop_gracefully("scale-down", restart=False)

    def _scale_up(self) -> Fault:
        proc = self.start_consumer()
        member = next(m for m, p in self.consumers.items() if p is proc)
        return Fault(time.time(), "scale-up", member, proc.pid)

    def _consumer_stop(self) -> Fault:
        member = self.rng.choice(self._targets())
        proc = self.consumers[member]
        at = proc.freeze()
        self.frozen.add(member)
        index = len(self.faults)  # where this fault lands in self.faults

        def resume() -> None:
            proc.signal(signal.SIGCONT)
            self.frozen.discard(member)
            self.faults[index] = dataclasses.replace(self.faults[index], until=time.time())

        self._later(2, 12, f"SIGCONT {member}", resume)
        return Fault(at, FREEZE, member, proc.pid)

    def _kill_etcd(self, kind: str, leader: bool) -> Fault:
        try:
            chosen = self.etcd.leader()
        except RuntimeError as e:
            return Fault(time.time(), kind, "-", ok=False, detail=str(e))
        if not leader:
            chosen = self.rng.choice([m for m in self.etcd.members if m is not chosen])
        pid = chosen.process.pid if chosen.process is not None else None
        at = time.time()
        self.etcd.kill(chosen)
        self._later(5, 15, f"restart etcd {chosen.name}", lambda: chosen.start(timeout=60))
        return Fault(at, kind, chosen.name, pid)

    def _etcd_kill(self) -> Fault:
        return self._kill_etcd("etcd-kill", leader=False)

    def _etcd_leader_kill(self) -> Fault:
        return self._kill_etcd("etcd-leader-kill", leader=True)

    def _rabbit_kill(self) -> Fault:
        node = self.rng.choice(self.rabbit.nodes)
        pid = node.vm_pid()
        at = time.time()
        self.rabbit.kill(node)
        self._later(5, 15, f"restart {node.nodename}", lambda: self.rabbit.start_node(node))
        return Fault(at, BROKER_CRASH, node.nodename, pid)

    def _move(self) -> Fault:
        partition = self.rng.randrange(self.partitions)
        member = self.rng.choice(self._targets())
        at = time.time()
        ok, out = self.cli("move", self.fleet.stream, "-p", str(partition), "--to", member)
        return Fault(at, "move", f"p{partition}->{member}", ok=ok, detail=out)

    def _rebalance(self) -> Fault:
        at = time.time()
        ok, out = self.cli("rebalance", self.fleet.stream)
        return Fault(at, "rebalance", "-", ok=ok, detail=out)

    def _drain(self) -> Fault:
        member = self.rng.choice(self._targets())
        at = time.time()
        ok, out = self.cli("drain", self.fleet.stream, member)
        if ok:
            self.draining = member

            def cancel() -> None:
                done, said = self.cli("drain", self.fleet.stream, member, "--cancel")
                self.log(f"drain --cancel {member}: {said}")
                if done:
                    self.draining = None

            self._later(10, 30, f"drain --cancel {member}", cancel)
        return Fault(at, "drain", member, ok=ok, detail=out)
