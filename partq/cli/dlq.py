"""``partq dlq list|show|redrive|purge``: parked keys and dead letters (see
partq.coordinator.ops.dlq)."""

from __future__ import annotations

import base64
import binascii
import datetime
import json

import click

from partq.cli.context import Context, Seconds, grouped, pass_context
from partq.coordinator.ops import deadletters, dlq
from partq.coordinator.store.group import Group
from partq.kernel.amqp import blocking_connection
from partq.kernel.terminal import printable
from partq.producer.contract import StreamSpec, key_id


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


def _letter_row(d: deadletters.DeadLetter) -> str:
    failed = "?" if d.failed_ms is None else _when(d.failed_ms / 1000)
    error = _error_line(d.error_type, d.error)
    attempts = "?" if d.attempts is None else str(d.attempts)
    partition = "?" if d.partition is None else str(d.partition)
    return printable(
        f"{d.position:>5} {d.key_text or '(no key)':<24} {partition:>9} {attempts:>8}  "
        f"{failed:<19}  {(d.member or '?')[:16]:<16}  {error[:60]}"
    )


_LETTER_HEADING = (
    f"{'#':>5} {'key':<24} {'partition':>9} {'attempts':>8}  {'failed at (UTC)':<19}  "
    f"{'member':<16}  error"
)


_ONE_KEY = click.option(
    "--key", "-k", "key_text", help="Only this key [default: every parked key]."
)
_TIMEOUT = click.option(
    "--timeout", type=Seconds(), default=60.0, show_default=True, help="Seconds to wait for it."
)
_DEAD_LETTERS = click.option(
    "--dead-letters",
    is_flag=True,
    help="Act on the dead-letter queue's messages instead of parked keys.",
)
_LOOK = click.option(
    "--limit",
    type=click.IntRange(1, deadletters.MAX_PREFETCH),
    default=deadletters.WINDOW,
    show_default=True,
    help="Dead letters to look at, from the head of the queue (the output says if there "
    "were more).",
)


def _looked_at(looked: int, depth: int, queue: str) -> str:
    """The line saying a command looked at only part of the dead-letter queue."""
    more = (
        f"use --limit N (at most {deadletters.MAX_PREFETCH:,}) to look at more"
        if looked < deadletters.MAX_PREFETCH
        else "redrive or purge the ones in front first to reach the rest"
    )
    return (
        f"looked at the first {looked:,} of {depth:,} dead letters in {queue}; the other "
        f"{depth - looked:,} were not looked at: {more}"
    )


def _error_line(error_type: str | None, error: str | None) -> str:
    """A failure as Python prints it ("ValueError: why"): the error text already names its
    type when a consumer wrote it."""
    last = ((error or "").splitlines() or [""])[-1]
    if error_type and not last.startswith(f"{error_type}:") and last != error_type:
        return f"{error_type}: {last}" if last else error_type
    return last or "?"


@dlq_group.command("list")
@click.argument("stream")
@grouped
@click.option(
    "--limit",
    type=click.IntRange(0, deadletters.MAX_PREFETCH),
    default=100,
    show_default=True,
    help="Dead letters to show, from the head of the queue.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def list_(ctx: Context, stream: str, limit: int, as_json: bool) -> None:
    """The parked keys of STREAM (messages waiting, first error) and its dead letters
    (key, partition, attempts, when, by whom, error), oldest first.

    Dead letters are read without being consumed: they stay in the queue, in order.
    """
    spec = ctx.registry().read_spec(stream)
    keys = dlq.parked_keys(ctx.registry(), ctx.settings.amqp, spec)
    read = deadletters.read(ctx.settings.amqp, spec, limit)
    if as_json:
        doc = {
            "stream": stream,
            "on_failure": spec.on_failure,
            "parked": [k.to_dict() for k in keys],
            "dead_letters": read.depth,
            "dead_letter_messages": [d.to_dict() for d in read.letters],
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
    click.echo(f"dead letters in {spec.dead_letter_queue}: {read.depth}")
    if read.letters:
        click.echo(_LETTER_HEADING)
        for d in read.letters:
            click.echo(_letter_row(d))
        if not read.complete:
            click.echo(f"... {_looked_at(len(read.letters), read.depth, spec.dead_letter_queue)}")


@dlq_group.command()
@click.argument("stream")
@grouped
@click.option("--key", "-k", "key_text", required=True, help="The key (b64:<base64> if binary).")
@_LOOK
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_context
def show(ctx: Context, stream: str, key_text: str, limit: int, as_json: bool) -> None:
    """One key of STREAM: why it was parked, by whom, and what waits; and its dead letters
    among the first --limit of the queue (left there, in order)."""
    spec = ctx.registry().read_spec(stream)
    key = _key(key_text)
    assert key is not None
    found = dlq.parked_keys(ctx.registry(), ctx.settings.amqp, spec, key)
    read = deadletters.read(ctx.settings.amqp, spec, limit)
    letters = [d for d in read.letters if d.matches(key)]
    queue = spec.dead_letter_queue
    if not found and not letters:
        among = f"its {read.depth:,} dead letters"
        if not read.complete:
            among = f"the {_looked_at(len(read.letters), read.depth, queue)}"
        raise click.UsageError(f"key {key_text!r} is neither parked in {stream} nor among {among}")
    doc = found[0].to_dict() if found else {"key": key_text, "parked": False}
    if as_json:
        doc["dead_letters"] = read.depth
        doc["dead_letters_looked_at"] = len(read.letters)
        doc["dead_letter_messages"] = [d.to_dict() for d in letters]
        click.echo(json.dumps(doc, indent=2))
        return
    if found:
        doc["parked_at"] = _when(found[0].record.at) + " UTC"
    for name, value in doc.items():
        if name != "redrive_error" or value is not None:  # None: no redrive failed
            click.echo(printable(f"{name:>11}: {value}"))
    among = "" if read.complete else f" among the first {len(read.letters):,}"
    click.echo(f"dead letters of this key{among} in {queue}: {len(letters)}")
    for d in letters:
        failed = "?" if d.failed_ms is None else _when(d.failed_ms / 1000) + " UTC"
        click.echo(
            printable(
                f"  #{d.position}: partition {d.partition}, attempts {d.attempts}, "
                f"failed {failed} on {d.member}, message id {d.message_id}, {d.size} bytes"
            )
        )
        click.echo(printable(f"    {_error_line(d.error_type, d.error)}"))
    if not read.complete:
        click.echo(_looked_at(len(read.letters), read.depth, queue))


@dlq_group.command()
@click.argument("stream")
@grouped
@_ONE_KEY
@_TIMEOUT
@_DEAD_LETTERS
@_LOOK
@pass_context
def redrive(
    ctx: Context, stream: str, key_text: str | None, timeout: float, dead_letters: bool, limit: int
) -> None:
    """Replay parked keys through the handler, in order, ahead of anything newer; unpark them.

    The owner of each key's partition replays it when it reaches the request in the
    partition's queue. Safe to interrupt and run again.

    With --dead-letters: publish the dead letters (of --key, or all) back into their
    partitions in their dead-letter-queue order, without the error headers, each removed
    from the queue only once the broker confirmed its copy. They go to the BACK of the
    partition: behind any newer message of the same key already there, which is then
    handled first. An interrupted run is safe to run again (a message confirmed but not
    yet removed is published twice). Dead letters that arrive during the run stay. With
    --key, it looks at the first --limit dead letters it keeps (and says so if there were
    more).
    """
    if dead_letters:
        _act_on_dead_letters(ctx, stream, key_text, "redrive", limit)
        return
    _act(ctx, stream, key_text, "redrive", timeout)


@dlq_group.command()
@click.argument("stream")
@grouped
@_ONE_KEY
@click.option("--yes", is_flag=True, help="Yes, delete the messages.")
@_TIMEOUT
@_DEAD_LETTERS
@_LOOK
@pass_context
def purge(
    ctx: Context,
    stream: str,
    key_text: str | None,
    yes: bool,
    timeout: float,
    dead_letters: bool,
    limit: int,
) -> None:
    """Delete parked messages (and, without --key, every dead letter); the keys flow again.

    With --dead-letters: delete only dead letters (of --key, or all); the others stay, in
    order. With --key, it looks at the first --limit dead letters it keeps (and says so if
    there were more).
    """
    if not yes:
        what = (
            f"key {key_text!r}'s parked messages"
            if key_text
            else "every parked message and dead letter"
        )
        if dead_letters:
            what = f"key {key_text!r}'s dead letters" if key_text else "every dead letter"
        raise click.UsageError(f"this deletes {what} of {stream}: add --yes")
    if dead_letters:
        _act_on_dead_letters(ctx, stream, key_text, "purge", limit)
        return
    _act(ctx, stream, key_text, "purge", timeout)
    if key_text is None:
        spec = ctx.registry().read_spec(stream)
        with blocking_connection(ctx.settings.amqp) as connection:
            frame = connection.channel().queue_purge(spec.dead_letter_queue)
        click.echo(f"{spec.dead_letter_queue}: {frame.method.message_count} dead letters purged")


def _act_on_dead_letters(
    ctx: Context, stream: str, key_text: str | None, action: dlq.Action, limit: int
) -> None:
    spec = ctx.registry().read_spec(stream)
    acted = deadletters.act(ctx.settings.amqp, spec, action, _key(key_text), limit)
    whose = f"key {key_text!r}" if key_text else "every key"
    where = " into their partitions" if action == "redrive" else ""
    done = {"redrive": "redriven", "purge": "purged"}[action]
    queue = spec.dead_letter_queue
    rest = (
        f"{acted.kept:,} left in {queue}"
        if acted.complete
        else _looked_at(acted.looked, acted.depth, queue)
    )
    click.echo(printable(f"{stream}: {acted.done:,} dead letters of {whose} {done}{where}; {rest}"))
    if acted.unroutable:
        raise click.ClickException(
            f"{acted.unroutable} dead letters cannot be redriven (no key and no partition, or "
            f"a `partq dlq` request the consumer refused) and stay in {spec.dead_letter_queue}: "
            f"see them with `partq dlq list {stream} --json`, then purge them "
            f"(`partq dlq purge {stream} --dead-letters [--key K] --yes`)"
        )


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
        dead = dlq.dead_letter_depth(ctx.settings.amqp, spec)
        hint = f"; {dead} dead letters: add --dead-letters to act on them" if dead else ""
        click.echo(f"stream {stream}: no parked keys (on failure {spec.on_failure}){hint}")
        return
    requests = dlq.requests(ctx.settings.amqp, spec, records, action)
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
