"""``partq coordinator``: the coordinator daemon for one or more streams."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import click

from partq.cli.context import Context, Seconds, pass_context, scope_of
from partq.cli.web import base_url, http_options, serve_http, server_context
from partq.consumers.control.signals import on_stop_signals
from partq.coordinator.leader.policy import standby_mode
from partq.coordinator.leader.service import CoordinatorConfig, StreamCoordinator
from partq.coordinator.ops.probes import DepthExporter, EtcdHealth, QueueDepths
from partq.coordinator.ops.status import render_html, snapshot_status
from partq.coordinator.ops.trends import Trends, sample_of
from partq.kernel.amqp import AmqpURL
from partq.kernel.errors import PartqError
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

log = logging.getLogger("partq.cli")


@click.command()
@click.argument("streams", nargs=-1, required=True)
@click.option(
    "--group",
    "groups",
    multiple=True,
    help="Coordinate this consumer group of each stream; repeat it for several "
    "[default: the default group]. STREAM~GROUP names one group of one stream.",
)
@click.option("--min-members", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--settle",
    type=Seconds(),
    default=1.0,
    show_default=True,
    help="Seconds the member set must stay unchanged before assigning.",
)
@click.option("--max-moves", type=click.IntRange(min=1), help="Partitions in motion at most.")
@click.option("--manual", is_flag=True, help="Move nothing until `partq rebalance`.")
@click.option("--ttl", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "--standby/--no-standby",
    default=None,
    help="Name a hot standby member per partition: it subscribes as the queue's waiting "
    "consumer and takes over within milliseconds when the owner's connection dies. "
    "Default (neither): on quorum queues (RabbitMQ 3.10 and 4), where standbys were shown "
    "to keep order through every fault, and not on classic queues; --standby names them "
    "on classic queues too.",
)
@click.option(
    "--balance",
    type=click.Choice(["count", "load"]),
    default="count",
    show_default=True,
    help="What to even out: partition counts, or (opt-in, lag-aware) the partitions' loads "
    "measured from the members' handling rates and the queue depths.",
)
@click.option(
    "--load-interval",
    type=Seconds(min=0.5),
    default=10.0,
    show_default=True,
    help="With --balance load: seconds between load measurements (and load moves).",
)
@click.option(
    "--load-moves",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="With --balance load: partitions moved from a live owner per measurement, at most.",
)
@click.option(
    "--unbound-grace",
    type=Seconds(),
    default=60.0,
    show_default=True,
    help="Seconds a claim on a lease no live member holds (a departed member draining) is "
    "honoured before the leader deletes it; longer than the consumers' --drain-timeout.",
)
@http_options(default_port=9400)
@pass_context
def coordinator(
    ctx: Context,
    streams: tuple[str, ...],
    groups: tuple[str, ...],
    min_members: int,
    settle: float,
    max_moves: int | None,
    manual: bool,
    ttl: int,
    standby: bool | None,
    balance: str,
    load_interval: float,
    load_moves: int,
    unbound_grace: float,
    http_host: str,
    http_port: int,
) -> None:
    """Run a coordinator for STREAMS (one leads per stream; run several for failover)."""
    security = ctx.settings.http
    server_context(security)  # a certificate that cannot be used: exit 2 before connecting
    registry = ctx.registry()
    streams = tuple(scope_of(s, g) for s in streams for g in (groups or (None,)))
    for stream in streams:
        registry.read_spec(stream)  # fail now, not in a thread, for a stream that does not exist
    config = CoordinatorConfig(
        min_members=min_members,
        settle=settle,
        max_moves=max_moves,
        manual=manual,
        ttl=ttl,
        standby=standby_mode(standby),
        balance="load" if balance == "load" else "count",
        load_interval=load_interval,
        load_moves=load_moves,
        unbound_grace=unbound_grace,
    )
    running = _Coordinators(registry, ctx.settings.amqp, streams, config)
    stop = threading.Event()
    server = serve_http(
        http_host,
        http_port,
        security,
        live=running.alive,
        ready=lambda: running.ready() and not stop.is_set(),
        page=running.page,
        before_metrics=running.export_depths,
    )
    log.info(
        "coordinating %s; status page on %s/%s",
        ", ".join(streams),
        base_url(http_host, server, security),
        " (bearer token required)" if security.token is not None else "",
    )
    on_stop_signals(stop.set)
    dead = running.run(stop)
    server.shutdown()
    running.depths.close()
    if dead:  # the traceback is logged by the thread; never exit 0 after a thread death
        log.error("coordinator of %s died; exiting 1", ", ".join(dead))
        raise click.exceptions.Exit(1)


class _Coordinators:
    """One coordinator thread per stream, and what the HTTP server asks of them: the status
    page, readiness, the queue depths exported on each scrape, and the trends sampled."""

    def __init__(
        self,
        registry: Registry,
        amqp: AmqpURL,
        streams: tuple[str, ...],
        config: CoordinatorConfig,
    ) -> None:
        self.registry, self.amqp = registry, amqp
        # One AMQP connection for every scrape, page load and load measurement, refreshed at
        # most every 2 s; etcd asked for /readyz at most as often. Failures: 503 with one line.
        self.depths = QueueDepths(amqp, name="partq-coordinator-depth")
        self.threads = [
            StreamCoordinator(registry, s, config, depths=self._ready_messages) for s in streams
        ]
        self.exporter = DepthExporter(self.depths)
        self.etcd = EtcdHealth(registry)
        self.trends = {t.stream: Trends() for t in self.threads}

    def run(self, stop: threading.Event) -> list[str]:
        """Run the threads until ``stop`` or one dies; stop them; the streams whose died."""
        for thread in self.threads:
            thread.start()
        while not stop.wait(1.0):
            if not self.alive():
                break
            self.sample_trends()
        dead = [t for t in self.threads if not t.is_alive()]  # before we stop them: they died
        for thread in self.threads:
            thread.stop()
        for thread in self.threads:
            thread.join(timeout=10)
        dead += [t for t in self.threads if t.failure is not None and t not in dead]
        return [t.stream for t in dead]

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def ready(self) -> bool:
        self.etcd.check()  # raises with the reason: 503
        for thread in self.threads:
            thread.check()  # a stream missing (deleted, or its spec malformed): 503, saying so
        return True

    def export_depths(self) -> None:
        leading = [t for t in self.threads if t.leading.is_set()]
        self.exporter.export(t.spec for t in leading if t.spec is not None)

    def page(self) -> str:
        return render_html([self.console_report(t) for t in self.threads])

    def sample_trends(self) -> None:
        """One sample per stream every few seconds, whether or not anyone looks."""
        for thread in self.threads:
            now = time.time()
            if not self.trends[thread.stream].due(now):
                continue
            try:
                report = snapshot_status(
                    self.registry, self.amqp, thread.stream, depths=self.depths.stats
                )
            except PartqError as e:  # etcd or RabbitMQ away: a gap in the charts
                log.debug("no trend sample of %s: %s", thread.stream, e)
                continue
            self.trends[thread.stream].record(sample_of(report, now))

    def console_report(self, thread: StreamCoordinator) -> dict[str, Any]:
        """The stream's report, with what this process saw lately
        (partq.coordinator.ops.history)."""
        report = snapshot_status(self.registry, self.amqp, thread.stream, depths=self.depths.stats)
        rows = report["rows"]
        found = {row["partition"]: row["messages"] for row in rows if row["messages"] is not None}
        rates = thread.history.depths(found)
        for row in rows:
            row["rate"] = rates.get(row["partition"])
        report["timeline"] = [dataclasses.asdict(e) for e in thread.history.entries()]
        now, kept = time.time(), self.trends[thread.stream]
        kept.record(sample_of(report, now))
        report["trends"], report["trends_now"] = kept.samples(now), now
        report["trends_window"] = kept.window
        spec = thread.spec
        if spec is not None:
            report["dead_letters"] = self.depths.messages(spec.dead_letter_queue)
            for key in report["parked"]:
                key["messages"] = self.depths.messages(key["queue"])
        return report

    def _ready_messages(self, spec: StreamSpec) -> dict[int, int]:
        return {
            q.partition: q.messages
            for q in self.depths.stats(spec)
            if q.messages is not None and q.partition < spec.partitions
        }
