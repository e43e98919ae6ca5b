"""A RabbitMQ cluster of private nodes on loopback, for tests and benchmarks.

    with RabbitCluster(directory, size=3) as cluster:
        cluster.urls            # one amqp:// URL per node (join with "," for PARTQ_AMQP_URL)
        cluster.kill(i)         # kill -9 of node i's Erlang VM
        cluster.leaders(spec)   # node of each partition queue's quorum leader

From the installed package (or, given ``install=TREE_40``, RabbitMQ 4.0.5 chrooted in the
trixie tree; tests/rabbit.py), never touching the machine's broker: each node has its own
name (``partqcN@localhost``), AMQP and distribution ports, ``HOME`` (the one Erlang
cookie), data and log folders and config files; one private epmd serves them all (started
in the foreground, so its PID is known). The nodes form the cluster at boot
(``cluster_formation.classic_config``). ``/usr/lib/rabbitmq/bin`` scripts are called
directly: the ``/usr/sbin`` wrappers switch user and drop the environment. Everything is
stopped by PID in ``__exit__``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from partq.producer.contract import StreamSpec

from partq.kernel.errors import PartqError
from partq.kernel.local import LocalEtcd, free_port
from tests.rabbit import (
    MACHINE,
    RABBIT_BIN,
    Install,
    node_env,
    on_new_ports,
    start_error,
    write_cookie,
)

__all__ = [
    "RABBIT_BIN",
    "EtcdCluster",
    "RabbitCluster",
    "SparkStandalone",
    "kill_session",
    "session_processes",
]


@dataclass
class _Node:
    name: str
    directory: Path
    amqp_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    server: subprocess.Popen[bytes] | None = None

    @property
    def nodename(self) -> str:
        return f"{self.name}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    def vm_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.directory / "rabbit.pid").read_text().strip())
        return None


class _Managed:
    """``with X(...) as x``: started on entry, stopped (by PID) on exit."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RabbitCluster(_Managed):
    def __init__(
        self, directory: Path, size: int = 3, install: Install = MACHINE, extra_config: str = ""
    ) -> None:
        self.install = install
        self.extra_config = extra_config  # lines appended to every node's rabbitmq.conf
        self.directory = directory = install.home(directory, "partqc")
        self.epmd_port = free_port()
        self.cookie = secrets.token_hex(16)
        self.nodes = [_Node(f"partqc{i + 1}", directory / f"n{i + 1}") for i in range(size)]
        self._epmd: subprocess.Popen[bytes] | None = None

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def env(self, node: _Node) -> dict[str, str]:
        return node_env(
            self.install, node.directory, node.nodename, node.amqp_port, node.dist_port,
            self.epmd_port,
        )  # fmt: skip

    def _configure(self, node: _Node) -> None:
        d = node.directory
        d.mkdir(parents=True, exist_ok=True)
        write_cookie(d, self.cookie)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[].\n")
        peers = "".join(
            f"cluster_formation.classic_config.nodes.{i + 1} = {n.nodename}\n"
            for i, n in enumerate(self.nodes)
        )
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{node.amqp_port}\n"
            "loopback_users = none\n"
            "cluster_formation.peer_discovery_backend = classic_config\n"
            f"{peers}{self.extra_config}"
        )

    def start(self, timeout: float = 120.0, attempts: int = 3) -> RabbitCluster:
        """Start every node, the cluster again on new ports where one was taken."""
        return on_new_ports(lambda: self._start(timeout), self._new_ports, attempts)

    def _new_ports(self) -> None:
        self.epmd_port = free_port()
        for node in self.nodes:  # a fresh node directory too: nothing of the failed start
            shutil.rmtree(node.directory, ignore_errors=True)
            node.amqp_port, node.dist_port = free_port(), free_port()

    def _start(self, timeout: float) -> RabbitCluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.install.mount()
        with (self.directory / "epmd.out").open("wb") as log:
            self._epmd = subprocess.Popen(
                self.install.command("epmd", "-port", str(self.epmd_port)), stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.install.base_env(), "ERL_EPMD_ADDRESS": "127.0.0.1"},
            )  # fmt: skip
        for node in self.nodes:
            self._configure(node)
            self.start_node(node, wait=False)
        try:
            for node in self.nodes:
                self.wait(node, timeout)
        except Exception:
            self.stop()
            raise
        return self

    def start_node(self, node: _Node, *, wait: bool = True, timeout: float = 120.0) -> None:
        with (node.directory / "server.out").open("ab") as log:
            node.server = subprocess.Popen(
                self.install.command("rabbitmq-server"), env=self.env(node), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        if wait:
            self.wait(node, timeout)

    def wait(self, node: _Node, timeout: float = 120.0) -> None:
        try:
            pid_file = str(self.install.inside(node.directory / "rabbit.pid"))
            self.ctl(node, "wait", "--timeout", str(int(timeout)), pid_file, timeout=timeout + 10)
        except subprocess.CalledProcessError:
            tail = (node.directory / "server.out").read_text(errors="replace")[-2000:]
            raise start_error(f"RabbitMQ node {node.nodename}", tail) from None

    def upgrade_ctl(self, node: _Node, *args: str, timeout: float = 180.0) -> str:
        """``rabbitmq-upgrade`` against ``node`` (e.g. ``await_online_quorum_plus_one``)."""
        done = subprocess.run(
            self.install.command("rabbitmq-upgrade", "-n", node.nodename, *args),
            env=self.env(node), capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return done.stdout

    def ctl(self, node: _Node, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            self.install.command("rabbitmqctl", "-n", node.nodename, *args), env=self.env(node),
            capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return done.stdout

    def running(self) -> list[str]:
        """The running nodes, as the first live node sees them."""
        for node in self.nodes:
            if node.server is not None and node.server.poll() is None:
                out = self.ctl(node, "cluster_status", "--formatter", "json")

                return sorted(json.loads(out).get("running_nodes", []))
        return []

    def leaders(self, spec: StreamSpec) -> dict[int, str]:
        """The node leading each partition queue of ``spec`` (quorum queues)."""
        live = next(n for n in self.nodes if n.server is not None and n.server.poll() is None)
        out = self.ctl(live, "list_queues", "-q", "--no-table-headers", "name", "leader")
        found = {}
        for line in out.splitlines():
            name, _, leader = line.partition("\t")
            for p in range(spec.partitions):
                if name == spec.queue(p):
                    found[p] = leader.strip()
        return found

    def node(self, nodename: str) -> _Node:
        return next(n for n in self.nodes if n.nodename == nodename)

    def kill(self, node: _Node) -> None:
        """kill -9 of the node's Erlang VM (and what its start script left)."""
        pid = node.vm_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if node.server is not None:
            with contextlib.suppress(OSError):
                os.killpg(node.server.pid, signal.SIGKILL)
            node.server.wait(timeout=30)
            node.server = None

    def heal(self, timeout: float = 120.0) -> list[str]:
        """Start every node that a test killed or stopped (and wait for it); their names."""
        down = [n for n in self.nodes if n.server is None or n.server.poll() is not None]
        for node in down:
            self.start_node(node, timeout=timeout)
        return [n.nodename for n in down]

    def stop_node(self, node: _Node) -> None:
        server, node.server = node.server, None
        if server is None:
            return
        pid = node.vm_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(OSError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        time.sleep(0.2)

    def stop(self) -> None:
        for node in self.nodes:
            self.stop_node(node)
        epmd, self._epmd = self._epmd, None
        if epmd is not None:
            epmd.terminate()
            epmd.wait(timeout=10)
        self.install.unmount()
        if self.install.chrooted:
            shutil.rmtree(self.directory, ignore_errors=True)


class EtcdCluster(_Managed):
    """Three (``size``) members of etcd on loopback, each a :class:`LocalEtcd`:
    ``endpoints`` for PARTQ_ETCD_ENDPOINTS, ``kill`` one by PID, ``leader()``. Stopped by
    PID in ``__exit__``; a killed member's ``process`` is None."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.members = [
            LocalEtcd(data_dir=directory / f"m{i + 1}", name=f"m{i + 1}") for i in range(size)
        ]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = cluster

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def status(self, member: LocalEtcd) -> dict[str, Any] | None:
        """``etcdctl endpoint status`` of one member, or None if it does not answer."""
        try:
            found: list[dict[str, Any]] = json.loads(
                member.etcdctl("endpoint", "status", "-w", "json", timeout=10)
            )
        except (PartqError, subprocess.TimeoutExpired, ValueError):
            return None
        return found[0] if found else None

    def leader(self) -> LocalEtcd:
        for member in self.members:
            status = self.status(member) if member.process is not None else None
            if status is not None and (
                status["Status"]["header"]["member_id"] == status["Status"]["leader"]
            ):
                return member
        raise RuntimeError("no etcd leader")

    def kill(self, member: LocalEtcd) -> None:
        if member.process is not None:
            member.process.kill()
            member.process.wait(10)
            member.process = None

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        try:
            for member in self.members:
                assert member.data_dir is not None
                member.data_dir.mkdir(parents=True, exist_ok=True)
                member.start()  # returns once its client port is open
            deadline = time.monotonic() + timeout
            for member in self.members:
                while self.status(member) is None:  # serving: the cluster has a leader
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"etcd member {member.name} did not answer")
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop()


class SparkStandalone(_Managed):
    """A Spark standalone master and one-core workers on loopback, from pyspark's own
    ``bin/spark-class``. Each worker runs in its own session with its executors, so
    :meth:`kill_worker` is a kill -9 of the worker and everything it started; every
    process is stopped by PID (its session) in :meth:`stop`."""

    def __init__(self, directory: Path) -> None:
        import pyspark

        self.home = Path(pyspark.__file__).parent
        self.directory = directory
        self.port = free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SPARK_HOME": str(self.home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": str(self.directory / "local"),
            "PYSPARK_PYTHON": sys.executable,
            "JDK_JAVA_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / f"{name}.out").open("ab") as log:
            return subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *args], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def start(self, timeout: float = 60.0) -> SparkStandalone:
        self.master = self._spawn(
            "master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.port), "--webui-port", str(free_port()),
        )  # fmt: skip
        try:
            self.start_worker(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, timeout: float = 60.0) -> subprocess.Popen[bytes]:
        """A worker with 1 core and 1 GB, registered with the master when this returns."""
        index = len(self.workers) + 1
        worker = self._spawn(
            f"worker{index}", "org.apache.spark.deploy.worker.Worker", self.url,
            "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
            "--webui-port", str(free_port()), "--work-dir", str(self.directory / f"work{index}"),
        )  # fmt: skip
        self.workers.append(worker)
        log = self.directory / "master.out"
        deadline = time.monotonic() + timeout
        while log.read_text(errors="replace").count("Registering worker") < index:
            if time.monotonic() > deadline or worker.poll() is not None:
                tail = (self.directory / f"worker{index}.out").read_text(errors="replace")
                raise RuntimeError(f"Spark worker {index} did not register: {tail[-2000:]}")
            time.sleep(0.2)
        return worker

    def kill_worker(self, worker: subprocess.Popen[bytes]) -> None:
        """kill -9 of the worker, its executors and their Python workers (its session)."""
        kill_session(worker.pid)
        worker.wait(timeout=10)

    def stop(self) -> None:
        for process in [*self.workers, *([self.master] if self.master else [])]:
            kill_session(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.workers = []
        self.master = None


def kill_session(session: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of ``session`` (a process we started in its own session)."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.1) + 1):
        pids = session_processes(session)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def session_processes(session: int) -> list[int]:
    """Live processes of the session ``session``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids
