"""``partq consume|coordinator|status|rebalance|move|drain``."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any, TypeVar

import click

from consumers.cli.context import Context
from consumers.daemon import (
    DEFAULT_HANDLER_TIMEOUT,
    EXIT_HANDLER_TIMEOUT,
    EXIT_STREAM_CHANGED,
    EXIT_WORKER_FAILED,
    Consumer,
    ConsumerConfig,
)
from consumers.http import serve
from consumers.message import load_handler
from consumers.signals import on_stop_signals
from coordinator.group import Drain, Group, Move, Rebalance, validate_member_id
from coordinator.probes import DepthExporter, EtcdHealth, QueueDepths
from coordinator.service import CoordinatorConfig, StreamCoordinator, plan
from coordinator.status import beyond_lines, malformed_lines, render_html, snapshot_status
from producer.errors import UsageError

pass_context = click.make_pass_decorator(Context)
F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("partq.cli")


def http_options(default_port: int) -> Callable[[F], F]:
    """``--http-host`` and ``--http-port`` for a daemon's /metrics, /livez, /readyz."""

    def decorate(command: F) -> F:
        command = click.option(
            "--http-port", type=click.IntRange(0, 65535), default=default_port,
            show_default=True, help="0: pick a free port (the chosen one is logged).",
        )(command)  # fmt: skip
        return click.option(
            "--http-host", default="127.0.0.1", show_default=True, envvar="PARTQ_HTTP_HOST",
            help="Address for /metrics, /livez, /readyz (0.0.0.0 in containers) "
            "[PARTQ_HTTP_HOST].",
        )(command)  # fmt: skip

    return decorate


def serve_http(host: str, port: int, **endpoints: Any) -> ThreadingHTTPServer:
    """:func:`consumers.http.serve`, with a bind failure as one line naming the flag to change
    (a :class:`UsageError`: exit code 2)."""
    try:
        return serve(host, port, **endpoints)
    except OSError as e:
        raise UsageError(bind_error(host, port, e)) from None


def bind_error(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    other_port = "choose another port with --http-port, or --http-port 0 for any free port"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is already in use (another partq daemon on this host?): {other_port}"
    if error.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied: {other_port}"
    reason = error.strerror or str(error)
    if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {reason}: check --http-host"
    return f"cannot listen on {where}: {reason}: check --http-host and --http-port"


@click.command()
@click.argument("stream")
@click.option("--handler", required=True, help="The handler, as pkg.module:function.")
@click.option(
    "--member-id",
    envvar="PARTQ_MEMBER_ID",
    help="Stable member id (e.g. pod name): ASCII letters, digits, _ . : @ -, starting with a "
    "letter or digit, at most 253 characters [PARTQ_MEMBER_ID].",
)
@click.option("--weight", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--prefetch", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--ttl", type=click.IntRange(min=1), default=5, show_default=True, help="Lease TTL in seconds."
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Handler attempts before a message goes to the dead-letter queue.",
)
@click.option("--drain-timeout", type=float, default=20.0, show_default=True)
@click.option(
    "--handler-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_HANDLER_TIMEOUT,
    show_default=True,
    help="Seconds a handler may take per message; past it the message is dead-lettered and "
    "the consumer leaves the group and exits with code 3 (a running handler cannot be "
    "stopped). 0: no limit.",
)
@click.option("--partitions", type=int, help="Expected partition count; refused if etcd differs.")
@http_options(default_port=9401)
@pass_context
def consume(
    ctx: Context,
    stream: str,
    handler: str,
    member_id: str | None,
    weight: int,
    prefetch: int,
    ttl: int,
    max_attempts: int,
    drain_timeout: float,
    handler_timeout: float,
    partitions: int | None,
    http_host: str,
    http_port: int,
) -> None:
    """Consume STREAM's assigned partitions with HANDLER until SIGTERM/SIGINT.

    \b
    Exit codes (every one after the start leaves the group first):
      0  stopped by a signal, every partition drained
      1  a runtime failure, or the drain took longer than --drain-timeout
      2  a usage or validation error
      3  a handler ran longer than --handler-timeout (its message is dead-lettered)
      4  a partition worker failed (the traceback is logged)
      5  the stream was deleted and recreated with another partition count
    Restart the process on 3, 4 and 5 (a supervisor does): /readyz is false meanwhile.
    """
    function = load_handler(handler)
    config = ConsumerConfig(
        stream=stream, member_id=member_id, weight=weight, prefetch=prefetch, ttl=ttl,
        max_attempts=max_attempts, drain_timeout=drain_timeout, partitions=partitions,
        handler_timeout=handler_timeout or None,
    )  # fmt: skip
    consumer = Consumer(ctx.registry(), function, config, amqp_url=ctx.settings.amqp)
    server = serve_http(
        http_host, http_port, live=consumer.alive.is_set, ready=consumer.ready.is_set
    )
    log.info(
        "member %s serving /livez /readyz /metrics on %s:%d",
        consumer.member,
        http_host,
        server.server_port,
    )
    on_stop_signals(consumer.stop)
    code = consumer.run()
    server.shutdown()
    if code in (EXIT_HANDLER_TIMEOUT, EXIT_WORKER_FAILED, EXIT_STREAM_CHANGED):
        exit_within(code, EXIT_GRACE)
    raise click.exceptions.Exit(code)


EXIT_GRACE = 10.0  # seconds the interpreter may take to exit after a failure


def exit_within(code: int, seconds: float) -> None:
    """End the process with ``code`` if the normal exit has not happened after ``seconds``.

    After a failure the group has been left already, but a hung handler thread
    cannot be stopped: if it holds something the interpreter's exit waits for (a
    non-daemon thread it started, a lock), only ``os._exit`` ends the process.
    """

    def force() -> None:
        log.error("exit blocked for %ss (a hung handler?): exiting with %d now", seconds, code)
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


@click.command()
@click.argument("streams", nargs=-1, required=True)
@click.option("--min-members", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--settle",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds the member set must stay unchanged before assigning.",
)
@click.option("--max-moves", type=click.IntRange(min=1), help="Partitions in motion at most.")
@click.option("--manual", is_flag=True, help="Move nothing until `partq rebalance`.")
@click.option("--ttl", type=click.IntRange(min=1), default=5, show_default=True)
@http_options(default_port=9400)
@pass_context
def coordinator(
    ctx: Context,
    streams: tuple[str, ...],
    min_members: int,
    settle: float,
    max_moves: int | None,
    manual: bool,
    ttl: int,
    http_host: str,
    http_port: int,
) -> None:
    """Run a coordinator for STREAMS (one leads per stream; run several for failover)."""
    registry = ctx.registry()
    for stream in streams:
        registry.read_spec(stream)  # fail now, not in a thread, for a stream that does not exist
    config = CoordinatorConfig(
        min_members=min_members, settle=settle, max_moves=max_moves, manual=manual, ttl=ttl
    )
    threads = [StreamCoordinator(registry, s, config) for s in streams]
    stop = threading.Event()
    # One AMQP connection for every scrape and page load, refreshed at most every 2 s;
    # etcd asked for /readyz at most as often. Failures: 503 with one line (consumers.http).
    depths = QueueDepths(ctx.settings.amqp, name="partq-coordinator-depth")
    exporter = DepthExporter(depths)
    etcd = EtcdHealth(registry)

    def page() -> str:
        reports = [
            snapshot_status(registry, ctx.settings.amqp, s, depths=depths.stats) for s in streams
        ]
        return render_html(reports)

    def ready() -> bool:
        etcd.check()  # raises with the reason: 503
        for thread in threads:
            thread.check()  # a stream missing (deleted, or its spec malformed): 503, saying so
        return not stop.is_set()

    def export_depths() -> None:
        exporter.export(t.spec for t in threads if t.leading.is_set() and t.spec is not None)

    server = serve_http(
        http_host,
        http_port,
        live=lambda: all(t.is_alive() for t in threads),
        ready=ready,
        page=page,
        before_metrics=export_depths,
    )
    log.info(
        "coordinating %s; status page on http://%s:%d/",
        ", ".join(streams),
        http_host,
        server.server_port,
    )
    on_stop_signals(stop.set)
    for thread in threads:
        thread.start()
    while not stop.wait(1.0):
        if not all(t.is_alive() for t in threads):
            break
    dead = [t for t in threads if not t.is_alive()]  # before we stop them: they died
    for thread in threads:
        thread.stop()
    for thread in threads:
        thread.join(timeout=10)
    server.shutdown()
    depths.close()
    dead += [t for t in threads if t.failure is not None and t not in dead]
    if dead:  # the traceback is logged by the thread; never exit 0 after a thread death
        log.error("coordinator of %s died; exiting 1", ", ".join(t.stream for t in dead))
        raise click.exceptions.Exit(1)


@click.command()
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True)
@pass_context
def status(ctx: Context, stream: str, as_json: bool) -> None:
    """Leader, members, assignment, claims, queue depths and moves in progress of STREAM."""
    report = snapshot_status(ctx.registry(), ctx.settings.amqp, stream)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    click.echo(f"stream {stream}: {report['partitions']} partitions, {report['queue_type']}")
    click.echo(f"leader: {report['leader'] or '-'}")
    click.echo(f"members ({len(report['members'])}):")
    for m in report["members"]:
        click.echo(
            f"  {m['id']:<30} weight {m['weight']}  age {m['age_s']:.0f}s  "
            f"owns {m['owns']}  host {m['host']} pid {m['pid']}"
        )
    for line in beyond_lines(report):
        click.echo(line)
    click.echo(f"unassigned: {report['unassigned'] or '-'}")
    click.echo(f"moves in progress: {report['in_motion'] or '-'}")
    click.echo(
        f"{'partition':>9}  {'owner':<30} {'claimed by':<30} {'messages':>8} {'consumers':>9}"
    )
    for row in report["rows"]:
        click.echo(
            f"{row['partition']:>9}  {row['owner'] or '-':<30} {row['claim'] or '-':<30} "
            f"{_num(row['messages']):>8} {_num(row['consumers']):>9}"
        )
    for line in malformed_lines(report):
        click.echo(line)


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.command()
@click.argument("stream")
@click.option("--dry-run", is_flag=True, help="Print the planned moves; change nothing.")
@click.option("--max-moves", type=click.IntRange(min=1))
@pass_context
def rebalance(ctx: Context, stream: str, dry_run: bool, max_moves: int | None) -> None:
    """Ask the leader to rebalance STREAM now (needed in --manual mode)."""
    registry = ctx.registry()
    spec = registry.read_spec(stream)
    group = Group(registry.client, registry.where, stream, report=False)
    state = group.snapshot()
    excluded = {r.member for r in state.requests.values() if isinstance(r, Drain)}
    target = plan(spec, state.members, state.assignment, state.claims, excluded, max_moves)
    changes = [
        (p, state.assignment.get(p), o)
        for p, o in sorted(target.items())
        if state.assignment.get(p) != o
    ]
    for partition, old, new in changes:
        click.echo(f"partition {partition}: {old or '(unassigned)'} -> {new}")
    click.echo(f"{len(changes)} partitions would change owner")
    if not dry_run:
        group.request(Rebalance())
        click.echo("rebalance requested; the leading coordinator carries it out")


@click.command()
@click.argument("stream")
@click.option("--partition", "-p", type=int, required=True)
@click.option("--to", "member", required=True, help="The member that should own it.")
@pass_context
def move(ctx: Context, stream: str, partition: int, member: str) -> None:
    """Move one partition of STREAM to MEMBER."""
    validate_member_id(member)
    registry = ctx.registry()
    spec = registry.read_spec(stream)
    if not 0 <= partition < spec.partitions:
        raise click.BadParameter(
            f"{stream} has partitions 0..{spec.partitions - 1}", param_hint="--partition"
        )
    group = Group(registry.client, registry.where, stream, report=False)
    if member not in group.snapshot().members:
        raise click.BadParameter(
            f"{member!r} is not a live member of {stream} (see partq status)", param_hint="--to"
        )
    group.request(Move(partition, member))
    click.echo(f"move of partition {partition} to {member} requested")


@click.command()
@click.argument("stream")
@click.argument("member")
@pass_context
def drain(ctx: Context, stream: str, member: str) -> None:
    """Move every partition of STREAM away from MEMBER (until it leaves)."""
    validate_member_id(member)
    registry = ctx.registry()
    registry.read_spec(stream)
    group = Group(registry.client, registry.where, stream, report=False)
    state = group.snapshot()
    if member not in state.members:
        raise click.BadParameter(f"{member!r} is not a live member of {stream}")
    group.request(Drain(member))
    owned = sorted(p for p, o in state.assignment.items() if o == member)
    click.echo(f"drain of {member} requested ({len(owned)} partitions to move)")


@click.command()
@click.option("--partitions", type=click.IntRange(1, 256), default=12, show_default=True)
@click.option("--ttl", type=click.IntRange(min=1), default=3, show_default=True)
@pass_context
def demo(ctx: Context, partitions: int, ttl: int) -> None:
    """End-to-end demo on a private etcd and the local RabbitMQ (about a minute)."""
    from consumers.demo import run_demo

    ok = run_demo(ctx.settings.amqp, partitions=partitions, ttl=ttl)
    raise click.exceptions.Exit(0 if ok else 1)
