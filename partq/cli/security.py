"""``partq security roles``: the least-privilege etcd roles and RabbitMQ users of a stream."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from partq.cli.context import Context, grouped, pass_context
from partq.coordinator.ops import grants, rights
from partq.kernel.etcd import etcd_errors


@click.group()
def security() -> None:
    """Least-privilege roles for partq's components."""


@security.command()
@click.argument("stream")
@grouped
@click.option(
    "--member",
    "members",
    multiple=True,
    help="A consumer member id that gets its own role (may write only its own member key); "
    "repeat it. Without it, one consumer role is shared by all members.",
)
@click.option("--vhost", default="/", show_default=True, help="RabbitMQ virtual host.")
@click.option("--json", "as_json", is_flag=True, help="Print the roles as JSON.")
@click.option(
    "--apply",
    is_flag=True,
    help="Create them: etcd roles and users through the configured etcd (as its root "
    "user), RabbitMQ users and permissions through rabbitmqctl.",
)
@click.option(
    "--passwords",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="With --apply: a folder holding one file per user, named after it, with its "
    "password (e.g. a mounted Secret). Users without one are left alone in RabbitMQ.",
)
@click.option(
    "--no-password",
    is_flag=True,
    help="With --apply: create etcd users without a password (client-certificate identities: "
    "the certificate's CN is the user name).",
)
@click.option(
    "--rabbitmqctl",
    default="rabbitmqctl",
    show_default=True,
    help="The rabbitmqctl to run with --apply.",
)
@click.option("--etcd/--no-etcd", "to_etcd", default=True, help="With --apply: etcd's part.")
@click.option(
    "--rabbitmq/--no-rabbitmq", "to_rabbitmq", default=True, help="With --apply: RabbitMQ's part."
)
@pass_context
def roles(
    ctx: Context,
    stream: str,
    members: tuple[str, ...],
    vhost: str,
    as_json: bool,
    apply: bool,
    passwords: Path | None,
    no_password: bool,
    rabbitmqctl: str,
    to_etcd: bool,
    to_rabbitmq: bool,
) -> None:
    """Print (or --apply) the etcd roles and RabbitMQ users of STREAM, one per component.

    Producer: reads the spec, publishes to the stream's exchange. Consumer: reads the
    stream, writes its member key and claims, consumes the partition queues, publishes
    dead letters. Coordinator: writes assignment and leader keys. Operator: writes
    requests. Admin: creates and deletes the stream. Role and user names are
    partq-STREAM-COMPONENT (partq-STREAM-consumer-MEMBER with --member). With --group G
    (not the default): G's consumer, coordinator and operator, named partq-STREAM~G-...,
    whose rights reach only G's queues and keys (the stream's producer and admin serve
    every group).
    """
    found = rights.roles(stream, members)
    if not apply:
        if as_json:
            click.echo(json.dumps([dataclasses.asdict(r) for r in found], indent=2))
        else:
            click.echo(rights.script(found, vhost=vhost), nl=False)
        return
    done: list[str] = []
    if to_etcd:
        registry = ctx.registry()
        with etcd_errors(registry.where):  # refused unless etcd's root: one line, not a trace
            done += grants.apply_etcd(registry.client, found, passwords, no_password=no_password)
    if to_rabbitmq:
        done += grants.apply_rabbitmq(found, passwords, vhost=vhost, rabbitmqctl=rabbitmqctl)
    for line in done:
        click.echo(line)
    click.echo(f"stream {stream}: {len(found)} roles applied")
