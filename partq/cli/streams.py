"""``partq stream create|resize|describe|list|delete``."""

from __future__ import annotations

import json

import click

from partq.cli.context import Context, Seconds, pass_context
from partq.coordinator.leader.resize import Phase, command_line
from partq.coordinator.leader.resizer import Resizer
from partq.coordinator.ops import admin
from partq.coordinator.ops.status import beyond_lines
from partq.kernel.errors import BrokerUnavailable, EtcdUnavailable, StreamNotFound
from partq.producer.contract import (
    MAX_PARTITIONS,
    ON_FAILURE,
    QUEUE_TYPES,
    StreamSpec,
    refuse_overlap,
)


@click.group()
def stream() -> None:
    """Create and inspect streams."""


@stream.command()
@click.argument("name")
@click.option(
    "--partitions", "-p", type=int, help="Fixed number of partitions (required without --adopt)."
)
@click.option(
    "--queue-type",
    type=click.Choice(QUEUE_TYPES),
    help="Queue type [default: quorum; with --adopt: detected from the queues].",
)
@click.option(
    "--replicas",
    type=int,
    help="Quorum queues: nodes each partition queue is replicated on "
    "(x-quorum-initial-group-size; at most the cluster's size) [default: the broker's].",
)
@click.option(
    "--on-failure",
    type=click.Choice(ON_FAILURE),
    help="A message that exhausts its retries: park its key (later messages of the key wait "
    "behind it, in order, until `partq dlq redrive`) or dead-letter the message alone "
    "(later ones overtake it) [default: park; an existing stream keeps its own].",
)
@click.option(
    "--adopt",
    is_flag=True,
    help="Restore a lost spec from the stream's queues in RabbitMQ: their count "
    "(p00000, p00001, ... up to the first missing) and their queue type; --on-failure and "
    "--replicas as given (the queues cannot tell them) [default: park, the broker's].",
)
@pass_context
def create(
    ctx: Context,
    name: str,
    partitions: int | None,
    queue_type: str | None,
    replicas: int | None,
    on_failure: str | None,
    adopt: bool,
) -> None:
    """Create stream NAME: its spec in etcd and its queues in RabbitMQ. Idempotent.

    Refused when RabbitMQ already has partition queues of NAME that disagree: queues
    beyond the count, or queues with no spec in etcd (then use --adopt).
    """
    refuse_overlap(name)  # before etcd: the caller's rights may not reach such a name
    if adopt:
        spec, created = admin.adopt_stream(
            ctx.registry(),
            ctx.settings.amqp,
            name,
            partitions=partitions,
            queue_type=queue_type,  # type: ignore[arg-type]
            on_failure=on_failure,  # type: ignore[arg-type]
            replicas=replicas,
        )
        verb = "adopted:" if created else "exists, unchanged:"
        click.echo(f"stream {name} {verb} {describe_spec(spec)}")
        return
    if partitions is None:
        raise click.UsageError(
            "give --partitions N (or --adopt to restore the spec from existing queues)"
        )
    if on_failure is None:  # parking keeps a key's order; an existing stream keeps its choice
        try:
            on_failure = ctx.registry().read_spec(name).on_failure
        except StreamNotFound:
            on_failure = "park"
    spec = StreamSpec(
        name,
        partitions,
        queue_type or "quorum",  # type: ignore[arg-type]
        on_failure=on_failure,  # type: ignore[arg-type]
        replicas=replicas,
    )
    created = admin.create_stream(ctx.registry(), ctx.settings.amqp, spec)
    verb = "created" if created else "exists, unchanged:"
    click.echo(f"stream {name} {verb} {describe_spec(spec)}")


def describe_spec(spec: StreamSpec) -> str:
    return (
        f"{spec.partitions} partitions"
        + (f" (epoch {spec.epoch})" if spec.epoch else "")
        + f", {spec.queue_type} queues"
        + (f" on {spec.replicas} replicas" if spec.replicas else "")
        + f", on failure {spec.on_failure}"
    )


@stream.command()
@click.argument("name")
@click.option(
    "--partitions",
    "-p",
    type=int,
    required=True,
    help=f"The new partition count (1 to {MAX_PARTITIONS:,}); the count of a resize that is "
    "running continues it.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Return once the old layout is drained and its queues retired (its consumers must "
    "run), not once producers publish the new one.",
)
@click.option(
    "--timeout",
    type=Seconds(),
    help="Give up after this many seconds; the resize stays recorded and running the command "
    "again continues it [default: 60; with --wait: 600].",
)
@pass_context
def resize(ctx: Context, name: str, partitions: int, wait: bool, timeout: float | None) -> None:
    """Change stream NAME's partition count online, keeping each key's order.

    Producers and consumers keep running. The old layout's bindings are cut (late
    old-layout publishes are returned to their producer, which republishes them), a fence
    ends every old queue, the new layout is bound and then switched in etcd. Keys that
    move wait only for their old partition's fence. A shrink's queues are deleted once
    drained and empty. The resize is recorded in etcd: killed anywhere, the same command
    continues it. Resize by doubling or halving where possible: fewer keys wait
    (docs/resize.md).
    """
    resizer = Resizer(ctx.registry(), ctx.settings.amqp, name)
    state = resizer.start(partitions)
    change = state.resize
    verb = "continuing the resize" if resizer.resumed else "resizing"
    click.echo(
        f"stream {name}: {verb} {change.old.partitions} -> {change.new.partitions} partitions "
        f"(epoch {change.new.epoch}), {state.phase.value}"
    )
    until = Phase.RETIRED if wait else Phase.SWITCHED
    try:
        state = resizer.run(until, timeout if timeout is not None else (600.0 if wait else 60.0))
    except (EtcdUnavailable, BrokerUnavailable) as e:
        again = command_line(name, partitions, wait=wait)
        raise click.ClickException(
            f"{e}. The resize is recorded in etcd ({resizer.phase}): once that is back, run "
            f"`{again}` again to continue it"
        ) from None
    if state.phase is Phase.RETIRED:
        click.echo(
            f"stream {name}: {change.new.partitions} partitions (epoch {change.new.epoch}); "
            f"the old layout is drained and retired"
        )
        return
    click.echo(
        f"stream {name}: producers publish {change.new.partitions} partitions (epoch "
        f"{change.new.epoch}); the old partitions drain as their consumers reach the fences. "
        f"Follow with `partq status {name}`; retire the old layout with "
        f"`{command_line(name, change.new.partitions, wait=True)}`"
    )


@stream.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def describe(ctx: Context, name: str, as_json: bool) -> None:
    """Show stream NAME's spec and, per partition, queue depth and consumers."""
    description = admin.describe(ctx.registry(), ctx.settings.amqp, name)
    if as_json:
        click.echo(json.dumps(description.to_dict(), indent=2))
        return
    spec = description.spec
    click.echo(f"stream {spec.name}: {describe_spec(spec)}")
    click.echo(f"{'partition':>9}  {'queue':<40} {'messages':>9} {'consumers':>9}")
    for q in description.queues:
        messages = "missing" if q.messages is None else str(q.messages)
        consumers = "-" if q.consumers is None else str(q.consumers)
        click.echo(f"{q.partition:>9}  {q.queue:<40} {messages:>9} {consumers:>9}")
    shown = description.to_dict()
    for line in beyond_lines({**shown, "stream": spec.name}):
        click.echo(line)


@stream.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def list_(ctx: Context, as_json: bool) -> None:
    """List the streams stored in etcd."""
    specs = ctx.registry().list_specs()
    if as_json:
        click.echo(json.dumps([json.loads(s.to_json()) for s in specs], indent=2))
        return
    if not specs:
        click.echo("no streams: create one with `partq stream create NAME -p N`")
    for spec in specs:
        click.echo(f"{spec.name}\t{spec.partitions}\t{spec.queue_type}")


@stream.command()
@click.argument("name")
@click.option("--yes", is_flag=True, help="Really delete the queues and their messages.")
@pass_context
def delete(ctx: Context, name: str, yes: bool) -> None:
    """Delete stream NAME: its queues (with their messages) and its etcd keys."""
    if not yes:
        raise click.UsageError(f"deleting {name} drops its messages: add --yes to confirm")
    admin.delete(ctx.registry(), ctx.settings.amqp, name)
    click.echo(f"stream {name} deleted")
