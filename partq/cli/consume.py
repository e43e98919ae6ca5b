"""``partq consume``: the consumer daemon."""

from __future__ import annotations

import logging
import os
import sys
import threading

import click

from partq.cli.context import Context, Seconds, expected_partitions, grouped, pass_context
from partq.cli.web import base_url, http_options, serve_http, server_context
from partq.consumers.control.daemon import (
    DEFAULT_HANDLER_TIMEOUT,
    EXIT_HANDLER_TIMEOUT,
    EXIT_PERMISSION_DENIED,
    EXIT_STREAM_CHANGED,
    EXIT_WORKER_FAILED,
    Consumer,
    ConsumerConfig,
)
from partq.consumers.control.signals import on_stop_signals
from partq.consumers.handling.message import load_handler
from partq.coordinator.store.codec import MAX_WEIGHT
from partq.kernel.settings import MAX_CONCURRENCY

log = logging.getLogger("partq.cli")


@click.command()
@click.argument("stream")
@grouped
@click.option(
    "--handler",
    required=True,
    help="The handler, as pkg.module:function; modules import from the current directory too.",
)
@click.option(
    "--member-id",
    envvar="PARTQ_MEMBER_ID",
    help="Stable member id (e.g. pod name): ASCII letters, digits, _ . : @ -, starting with a "
    "letter or digit, at most 253 characters [PARTQ_MEMBER_ID].",
)
@click.option("--weight", type=click.IntRange(min=1, max=MAX_WEIGHT), default=1, show_default=True)
@click.option("--prefetch", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--ttl", type=click.IntRange(min=1), default=5, show_default=True, help="Lease TTL in seconds."
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Handler attempts before a message parks its key or is dead-lettered (the stream's "
    "on-failure setting).",
)
@click.option(
    "--heartbeat",
    type=click.IntRange(min=1),
    default=None,
    help="AMQP heartbeat in seconds: RabbitMQ notices a frozen or cut-off consumer after a "
    "few of them and serves its partitions to their next owner. Default: the lease TTL.",
)
@click.option("--drain-timeout", type=Seconds(), default=20.0, show_default=True)
@click.option(
    "--handler-timeout",
    type=Seconds(),
    default=DEFAULT_HANDLER_TIMEOUT,
    show_default=True,
    help="Seconds a handler may take per message; past it the message is dead-lettered and "
    "the consumer leaves the group and exits with code 3 (a running handler cannot be "
    "stopped). 0: no limit.",
)
@expected_partitions
@click.option(
    "--announce-leave/--no-announce-leave",
    envvar="PARTQ_ANNOUNCE_LEAVE",
    default=True,
    show_default=True,
    help="On SIGTERM, first let the leader move this member's partitions to others while it "
    "consumes them (planned handoffs), then leave; without it, drain everything and leave at "
    "once (the others take over after the leader's settle time) [PARTQ_ANNOUNCE_LEAVE].",
)
@click.option(
    "--load-report",
    type=Seconds(),
    default=5.0,
    show_default=True,
    help="Seconds between this member's load reports in etcd (what it handled per "
    "partition: for `coordinator --balance load` and the status page). 0: none.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=MAX_CONCURRENCY),
    default=None,
    help="Messages of different keys of a partition handled at once, at most this many in "
    "the member (a key's own messages never overlap and keep their order); async handlers "
    "run that many coroutines. Default 1: one message at a time per partition; at most "
    f"{MAX_CONCURRENCY}, one handler thread each [PARTQ_CONCURRENCY].",
)
@click.option(
    "--handoff",
    type=click.Choice(["auto", "drain"]),
    default=None,
    help="How a planned handoff moves a partition. auto: by consumer priority where "
    "RabbitMQ switches to the higher-priority waiting consumer once the owner settled "
    "everything (4.0+, quorum queues), else the drain; drain: always the drain. Default "
    "auto [PARTQ_HANDOFF].",
)
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
    heartbeat: int | None,
    drain_timeout: float,
    handler_timeout: float,
    partitions: int | None,
    announce_leave: bool,
    load_report: float,
    concurrency: int | None,
    handoff: str | None,
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
      6  RabbitMQ refused the user a partition's queue (the line says what to grant)
    Restart the process on 3, 4, 5 and 6 (a supervisor does): /readyz is false meanwhile.
    """
    security = ctx.settings.http
    server_context(security)  # a certificate that cannot be used: exit 2 before connecting
    import_from_working_directory()
    function = load_handler(handler)
    given: dict[str, object] = {} if concurrency is None else {"concurrency": concurrency}
    if handoff is not None:
        given["handoff"] = handoff
    if heartbeat is not None:
        given["heartbeat"] = heartbeat
    config = ConsumerConfig.of(
        stream,
        ctx.settings,
        member_id=member_id,
        weight=weight,
        prefetch=prefetch,
        ttl=ttl,
        max_attempts=max_attempts,
        drain_timeout=drain_timeout,
        partitions=partitions,
        handler_timeout=handler_timeout or None,
        announce_leave=announce_leave,
        load_report=load_report,
        **given,
    )
    consumer = Consumer(ctx.registry(), function, config, amqp_url=ctx.settings.amqp)
    server = serve_http(
        http_host, http_port, security, live=consumer.alive.is_set, ready=consumer.ready.is_set
    )
    log.info(
        "member %s serving /livez /readyz /metrics on %s",
        consumer.member,
        base_url(http_host, server, security),
    )
    on_stop_signals(consumer.stop)
    code = consumer.run()
    server.shutdown()
    if code in (
        EXIT_HANDLER_TIMEOUT,
        EXIT_WORKER_FAILED,
        EXIT_STREAM_CHANGED,
        EXIT_PERMISSION_DENIED,
    ):
        exit_within(code, EXIT_GRACE)
    raise click.exceptions.Exit(code)


def import_from_working_directory() -> None:
    """Let handler modules import from the current directory, as gunicorn's and celery's
    do: a console script's ``sys.path`` starts with its ``bin/`` folder, not the directory
    it runs in. Appended, not prepended: a stray file there never hides an installed module.
    """
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)


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
