"""``partq status|rebalance|move|drain|pause|resume``: what an operator reads and asks for."""

from __future__ import annotations

import json
import logging

import click

from partq.cli.context import Context, grouped, pass_context
from partq.coordinator.leader.policy import differences, draining, leaving, plan
from partq.coordinator.ops.status import beyond_lines, malformed_lines, per_second, snapshot_status
from partq.coordinator.store.group import (
    Drain,
    Group,
    GroupState,
    Move,
    Pause,
    Rebalance,
    validate_member_id,
)
from partq.kernel.errors import PartqError, UsageError
from partq.kernel.terminal import printable
from partq.producer.contract import StreamSpec

log = logging.getLogger("partq.cli")
_ONE_PARTITION = click.option(
    "--partition",
    "-p",
    type=click.IntRange(min=0),
    help="Only this partition [default: every one].",
)


@click.command()
@click.argument("stream")
@grouped
@click.option("--json", "as_json", is_flag=True)
@pass_context
def status(ctx: Context, stream: str, as_json: bool) -> None:
    """Leader, members, assignment, claims, queue depths and moves in progress of STREAM."""
    report = snapshot_status(ctx.registry(), ctx.settings.amqp, stream)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    say = _say
    say(f"stream {stream}: {report['partitions']} partitions, {report['queue_type']}")
    say(f"leader: {report['leader'] or '-'}")
    say(f"members ({len(report['members'])}):")
    for m in report["members"]:
        marks = " DRAINED" if m.get("draining") else ""
        marks += " LEAVING" if m.get("leaving") else ""
        busy = f"in flight {m['in_flight']}  " if m.get("in_flight") is not None else ""
        if m.get("concurrency") is not None:
            busy += f"concurrency {m['concurrency']}  "
        if m.get("waiting_key") is not None:
            busy += f"longest key wait {m['waiting_s']:.1f}s ({m['waiting_key']})  "
        say(
            f"  {m['id']:<30} weight {m['weight']}  age {m['age_s']:.0f}s  "
            f"owns {m['owns']}  handled {per_second(m.get('handled_per_s'))}  {busy}"
            f"host {m['host']} pid {m['pid']}{marks}"
        )
    drained = [m["id"] for m in report["members"] if m.get("draining")]
    if drained:
        say(
            f"drained (given no partitions; undo: partq drain {stream} MEMBER --cancel): "
            + ", ".join(drained)
        )
    for m in report["members"]:
        if m.get("parking_stalled"):
            click.echo(
                f"  {m['id']}: partitions {m['parking_stalled']} wait: a message cannot be "
                "parked (its log says why)"
            )
    for line in beyond_lines(report):
        say(line)
    say(f"unassigned: {report['unassigned'] or '-'}")
    say(f"moves in progress: {report['in_motion'] or '-'}")
    say(f"paused: {report['paused'] or '-'}")
    parked = report["parked"]
    say(
        f"parked keys: {', '.join(k['key'] for k in parked[:10]) or '-'}"
        + (f" (+{len(parked) - 10} more; partq dlq list {stream})" if len(parked) > 10 else "")
    )
    say(
        f"{'partition':>9}  {'owner':<30} {'claimed by':<30} {'standby':<30} "
        f"{'messages':>8} {'consumers':>9}"
    )
    for row in report["rows"]:
        say(
            f"{row['partition']:>9}  {row['owner'] or '-':<30} {row['claim'] or '-':<30} "
            f"{row.get('standby') or '-':<30} {_num(row['messages']):>8} "
            f"{_num(row['consumers']):>9}"
        )
    for line in malformed_lines(report):
        say(line)


def _say(line: str) -> None:
    """Print one line of a report, its keys and names made safe for a terminal."""
    click.echo(printable(line))


def _warn(text: str) -> None:
    click.echo(f"partq: warning: {printable(text)}", err=True)


def _check_coordinators(group: Group, state: GroupState, waits: str) -> None:
    """Warn when no coordinator leads the stream (``waits``: what then happens to the
    request), or when its coordinators run with different policies."""
    stream = group.stream
    if not state.leaders:
        _warn(f"no coordinator leads {stream}: {waits} until one runs (partq coordinator {stream})")
        return
    try:
        found = group.policies()
    except PartqError as e:  # a role without the right to read them: say nothing more
        log.debug("cannot read the coordinators' policies: %s", e)
        return
    live = {name for _revision, name in state.leaders}
    differ = differences({name: p for name, p in found.items() if name in live})
    if differ:
        _warn(
            f"the coordinators of {stream} run with different policies ({'; '.join(differ)}): "
            f"the leader's applies, and a failover changes it: give them the same flags"
        )


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.command()
@click.argument("stream")
@grouped
@click.option("--dry-run", is_flag=True, help="Print the planned moves; change nothing.")
@click.option("--max-moves", type=click.IntRange(min=1))
@pass_context
def rebalance(ctx: Context, stream: str, dry_run: bool, max_moves: int | None) -> None:
    """Ask the leader to rebalance STREAM now (needed in --manual mode)."""
    registry = ctx.registry()
    spec = registry.read_spec(stream)
    group = Group(registry.client, registry.where, stream, report=False)
    state = group.snapshot()
    target = plan(spec, state, max_moves)  # what the leader writes (draining members left out)
    changes = [
        (p, state.assignment.get(p), o)
        for p, o in sorted(target.items())
        if state.assignment.get(p) != o
    ]
    for partition, old, new in changes:
        click.echo(printable(f"partition {partition}: {old or '(unassigned)'} -> {new}"))
    click.echo(f"{len(changes)} partitions would change owner")
    if not dry_run:
        _check_coordinators(group, state, "the request waits in etcd")
        group.request(Rebalance())
        click.echo("rebalance requested; the leading coordinator carries it out")


@click.command()
@click.argument("stream")
@grouped
@click.option("--partition", "-p", type=click.IntRange(min=0), required=True)
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
    state = group.snapshot()
    if member not in state.members:
        raise click.BadParameter(
            f"{member!r} is not a live member of {stream} (see partq status)", param_hint="--to"
        )
    _check_coordinators(group, state, "the move waits in etcd")
    group.request(Move(partition, member))
    click.echo(f"move of partition {partition} to {member} requested")


@click.command()
@click.argument("stream")
@grouped
@click.argument("member")
@click.option("--cancel", is_flag=True, help="Undo a drain: MEMBER gets partitions again.")
@click.option(
    "--force", is_flag=True, help="Drain even the last member not drained (nothing consumes)."
)
@pass_context
def drain(ctx: Context, stream: str, member: str, cancel: bool, force: bool) -> None:
    """Move every partition of STREAM away from MEMBER (until it leaves, or --cancel)."""
    validate_member_id(member)
    group, _spec = _group(ctx, stream)
    if cancel:
        if group.withdraw(Drain(member)):
            click.echo(f"drain of {member} cancelled: the leader gives it partitions again")
        else:
            click.echo(f"{member} is not drained in {stream}: nothing to cancel")
        return
    state = group.snapshot()
    if member not in state.members:
        raise click.BadParameter(f"{member!r} is not a live member of {stream}")
    others = set(state.members) - draining(state.requests) - leaving(state.members) - {member}
    if not others and not force:
        raise UsageError(
            f"{member} is the last member of {stream} that is not drained or leaving: "
            f"draining it leaves every partition unassigned (nothing consumes): start "
            f"another consumer first, or add --force"
        )
    _check_coordinators(group, state, "the drain waits in etcd")
    group.request(Drain(member))
    owned = sorted(p for p, o in state.assignment.items() if o == member)
    click.echo(
        f"drain of {member} requested ({len(owned)} partitions to move); "
        f"undo: partq drain {stream} {member} --cancel"
    )


@click.command()
@click.argument("stream")
@grouped
@_ONE_PARTITION
@pass_context
def pause(ctx: Context, stream: str, partition: int | None) -> None:
    """Pause STREAM (or one partition): its owner drains it and stops consuming, but keeps it.

    Messages wait in the partition's queue. The pause is kept in etcd: it holds across
    restarts, handoffs and coordinator failover until `partq resume`.
    """
    group, spec = _group(ctx, stream)
    if partition is not None and not 0 <= partition < spec.partitions:
        raise click.BadParameter(
            f"{stream} has partitions 0..{spec.partitions - 1}", param_hint="--partition"
        )
    _check_coordinators(group, group.snapshot(), "the pause holds, but nothing is reassigned")
    group.request(Pause(partition))
    what = "every partition" if partition is None else f"partition {partition}"
    click.echo(f"{stream}: {what} paused; its owner drains it and stops consuming")


@click.command()
@click.argument("stream")
@grouped
@_ONE_PARTITION
@pass_context
def resume(ctx: Context, stream: str, partition: int | None) -> None:
    """Resume what `partq pause` paused (without --partition: every pause of STREAM)."""
    group, _spec = _group(ctx, stream)
    requests = group.snapshot().requests
    if partition is None:
        names = sorted(n for n, r in requests.items() if isinstance(r, Pause))
    elif Pause().name in requests:
        raise click.UsageError(
            f"{stream} is paused as a whole: resume it all with `partq resume {stream}`"
        )
    else:
        names = [n for n in (Pause(partition).name,) if n in requests]
    if not names:
        click.echo(f"{stream}: nothing paused there")
        return
    for name in names:
        group.clear_request(name)
    click.echo(f"{stream}: resumed ({', '.join(names)})")


def _group(ctx: Context, stream: str) -> tuple[Group, StreamSpec]:
    registry = ctx.registry()
    spec = registry.read_spec(stream)
    return Group(registry.client, registry.where, stream, report=False), spec
