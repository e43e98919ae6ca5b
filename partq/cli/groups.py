"""``partq group create|list|describe|delete``: a stream's consumer groups (docs/groups.md)."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from partq.cli.context import Context, pass_context
from partq.cli.operate import status
from partq.coordinator.ops import groups


@click.group(name="group")
def group_group() -> None:
    """Consumer groups: each reads every message of its stream, at its own pace."""


@group_group.command()
@click.argument("stream")
@click.argument("group")
@pass_context
def create(ctx: Context, stream: str, group: str) -> None:
    """Create GROUP of STREAM: its own partition queues, bound like every other group's.

    It receives what is published from now on. Idempotent.
    """
    created = groups.create_group(ctx.registry(), ctx.settings.amqp, stream, group)
    verb = "created" if created else "exists:"
    click.echo(
        f"group {group} of {stream} {verb} consume it with `partq consume {stream} --group "
        f"{group} --handler MODULE:FUNCTION`, coordinate it with `partq coordinator {stream} "
        f"--group {group}`"
    )


@group_group.command(name="list")
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def list_(ctx: Context, stream: str, as_json: bool) -> None:
    """List STREAM's groups: live members and messages waiting in each."""
    found = groups.list_groups(ctx.registry(), ctx.settings.amqp, stream)
    if as_json:
        click.echo(json.dumps([asdict(g) for g in found], indent=2))
        return
    click.echo(f"{'group':<24} {'members':>7} {'messages':>9}")
    for g in found:
        messages = "-" if g.messages is None else str(g.messages)
        click.echo(f"{g.group:<24} {g.members:>7} {messages:>9}")


@group_group.command()
@click.argument("stream")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def describe(click_ctx: click.Context, stream: str, group: str, as_json: bool) -> None:
    """Describe GROUP of STREAM: members, owners and queue depths (`partq status --group`)."""
    click_ctx.invoke(status, stream=stream, group=group, as_json=as_json)


@group_group.command()
@click.argument("stream")
@click.argument("group")
@click.option("--yes", is_flag=True, help="Really delete the group's queues and messages.")
@click.option("--force", is_flag=True, help="Delete it even while members are live.")
@pass_context
def delete(ctx: Context, stream: str, group: str, yes: bool, force: bool) -> None:
    """Delete GROUP of STREAM: its queues (with their messages) and its etcd keys."""
    if not yes:
        raise click.UsageError(
            f"deleting group {group} of {stream} drops its messages: add --yes to confirm"
        )
    groups.delete_group(ctx.registry(), ctx.settings.amqp, stream, group, force=force)
    click.echo(f"group {group} of {stream} deleted")
