"""``partq dlq list|show|redrive|purge``: parked keys and dead letters (see coordinator.dlq)."""

from __future__ import annotations

import base64
import binascii
import datetime
import json

import click

from cli.context import Context, Seconds, pass_context
from coordinator import dlq
from coordinator.group import Group
from kernel.amqp import blocking_connection
from kernel.terminal import printable
from producer.contract import StreamSpec, key_id


@click.group("dlq")
def dlq_group() -> None:
    """Parked keys and dead letters: list, show, redrive, purge."""


def _key(text: str | None) -> str | bytes | None:
    """A key as typed: text, or b64:<base64> for a key that is not text (as `list` shows it)."""
    if text is None or not text.startswith("b64:"):
        return text
    try:
        return base64.b64decode(text[4:], validate=True)
    except binascii.Error:
        raise click.BadParameter("b64: must be followed by base64", param_hint="--key") from None


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


@dlq_group.command("list")
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def list_(ctx: Context, stream: str, as_json: bool) -> None:
    """The parked keys of STREAM (messages waiting, first error) and its dead letters."""
    spec = ctx.registry().read_spec(stream)
    keys = dlq.parked_keys(ctx.registry(), ctx.settings.amqp, spec)
    dead = dlq.dead_letter_depth(ctx.settings.amqp, spec)
    if as_json:
        doc = {
            "stream": stream,
            "on_failure": spec.on_failure,
            "parked": [k.to_dict() for k in keys],
            "dead_letters": dead,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"stream {stream}: on failure {spec.on_failure}; {len(keys)} parked keys")
    if keys:
        click.echo(f"{'key':<24} {'partition':>9} {'messages':>8}  {'parked at (UTC)':<19}  error")
        for k in keys:
            r = k.record
            count = "?" if k.messages is None else str(k.messages)
            # the error is Python's own line for the exception: "ValueError: why"
            error = (r.error.splitlines() or [r.error_type])[-1]
            click.echo(
                printable(
                    f"{r.key_text:<24} {r.partition:>9} {count:>8}  {_when(r.at):<19}  {error[:80]}"
                )
            )
    click.echo(f"dead letters in {spec.dead_letter_queue}: {'?' if dead is None else dead}")


@dlq_group.command()
@click.argument("stream")
@click.option("--key", "-k", "key_text", required=True, help="The key (b64:<base64> if binary).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def show(ctx: Context, stream: str, key_text: str, as_json: bool) -> None:
    """One parked key of STREAM: why it was parked, by whom, and what waits."""
    spec = ctx.registry().read_spec(stream)
    key = _key(key_text)
    assert key is not None
    found = dlq.parked_keys(ctx.registry(), ctx.settings.amqp, spec, key)
    if not found:
        raise click.UsageError(f"key {key_text!r} is not parked in {stream}")
    doc = found[0].to_dict()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    doc["parked_at"] = _when(found[0].record.at) + " UTC"
    for name, value in doc.items():
        click.echo(printable(f"{name:>11}: {value}"))


@dlq_group.command()
@click.argument("stream")
@click.option("--key", "-k", "key_text", help="Only this key [default: every parked key].")
@click.option(
    "--timeout",
    type=Seconds(),
    default=60.0,
    show_default=True,
    help="Seconds to wait for it.",
)
@pass_context
def redrive(ctx: Context, stream: str, key_text: str | None, timeout: float) -> None:
    """Replay parked keys through the handler, in order, ahead of anything newer; unpark them.

    The owner of each key's partition replays it when it reaches the request in the
    partition's queue. Safe to interrupt and run again.
    """
    _act(ctx, stream, key_text, "redrive", timeout)


@dlq_group.command()
@click.argument("stream")
@click.option("--key", "-k", "key_text", help="Only this key [default: every parked key].")
@click.option("--yes", is_flag=True, help="Yes, delete the messages.")
@click.option(
    "--timeout",
    type=Seconds(),
    default=60.0,
    show_default=True,
    help="Seconds to wait for it.",
)
@pass_context
def purge(ctx: Context, stream: str, key_text: str | None, yes: bool, timeout: float) -> None:
    """Delete parked messages (and, without --key, every dead letter); the keys flow again."""
    if not yes:
        what = (
            f"key {key_text!r}'s parked messages"
            if key_text
            else "every parked message and dead letter"
        )
        raise click.UsageError(f"this deletes {what} of {stream}: add --yes")
    _act(ctx, stream, key_text, "purge", timeout)
    if key_text is None:
        spec = ctx.registry().read_spec(stream)
        with blocking_connection(ctx.settings.amqp) as connection:
            frame = connection.channel().queue_purge(spec.dead_letter_queue)
        click.echo(f"{spec.dead_letter_queue}: {frame.method.message_count} dead letters purged")


def _act(
    ctx: Context, stream: str, key_text: str | None, action: dlq.Action, timeout: float
) -> None:
    registry = ctx.registry()
    spec: StreamSpec = registry.read_spec(stream)
    records = Group(registry.client, registry.where, stream, report=False).parked()
    key = _key(key_text)
    if key is not None:
        records = {n: r for n, r in records.items() if n == key_id(key)}
        if not records:
            raise click.UsageError(
                f"key {key_text!r} is not parked in {stream}: nothing to {action}"
            )
    if not records:
        click.echo(f"stream {stream}: no parked keys (on failure {spec.on_failure})")
        return
    requests = {
        name: dlq.request(ctx.settings.amqp, spec, record, action)
        for name, record in records.items()
    }
    click.echo(
        f"{stream}: {action} of {len(records)} parked keys requested; waiting for the owners"
    )
    left, failed = dlq.wait_unparked(registry, stream, requests, timeout)
    if failed:
        reasons = "; ".join(f"{r.key_text}: {r.redrive_error}" for r in failed.values())
        if left:
            reasons += f"; still parked after {timeout:g}s: " + ", ".join(
                sorted(records[n].key_text for n in left)
            )
        raise click.ClickException(
            f"the replay failed again, the key stays parked ({reasons}). Fix the handler or "
            f"the message, then run the command again (`partq dlq show {stream} --key KEY`)"
        )
    if left:
        names = ", ".join(sorted(records[n].key_text for n in left))
        raise click.ClickException(
            f"still parked after {timeout:g}s: {names}. The request waits in the partition's "
            f"queue: is a consumer running, and does the handler succeed now? "
            f"(`partq dlq list {stream}`; run the command again to wait more)"
        )
    done = {"redrive": "redriven", "purge": "purged"}[action]
    names = ", ".join(sorted(r.key_text for r in records.values()))
    click.echo(printable(f"{stream}: {names} {done} and unparked"))
