"""``partq produce NAME``: publish one message, or JSON lines from a file or stdin."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any

import click

from cli.context import Context, pass_context
from kernel.errors import UsageError
from producer.contract import refuse_control_headers
from producer.publisher import Producer, Receipt


@dataclass(frozen=True)
class Line:
    number: int
    key: str
    body: bytes
    headers: dict[str, Any] | None
    message_id: str | None


def parse_lines(stream: IO[str]) -> Iterator[Line | str]:
    """Yield a :class:`Line` per valid JSON line, or an error text naming the line."""
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            yield f'line {number}: not JSON ({e.msg}); expected {{"key": ..., "body": ...}}'
            continue
        if not isinstance(doc, dict) or "key" not in doc or "body" not in doc:
            yield f'line {number}: expected an object with "key" and "body"'
            continue
        key, body = doc["key"], doc["body"]
        if not isinstance(key, str):
            yield f'line {number}: "key" must be a string, got {type(key).__name__}'
            continue
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        headers = doc.get("headers")
        if headers is not None and not isinstance(headers, dict):
            yield f'line {number}: "headers" must be an object'
            continue
        try:
            refuse_control_headers(headers)
        except UsageError as e:
            yield f"line {number}: {e}"
            continue
        message_id = doc.get("message_id")
        yield Line(number, key, data, headers, None if message_id is None else str(message_id))


@click.command()
@click.argument("name")
@click.option("--key", "-k", help="Key of a single message.")
@click.option("--body", "-b", help="Body of a single message.")
@click.option(
    "--from",
    "source",
    type=click.File("r"),
    help='JSON lines {"key": …, "body": …} (\'-\' = stdin; the default without --key).',
)
@click.option("--partitions", type=int, help="Expected partition count; refused if etcd differs.")
@click.option(
    "--window",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Unconfirmed messages in flight at most.",
)
@pass_context
def produce(
    ctx: Context,
    name: str,
    key: str | None,
    body: str | None,
    source: IO[str] | None,
    partitions: int | None,
    window: int,
) -> None:
    """Publish keyed messages to stream NAME and print a summary."""
    if (key is None) != (body is None):
        raise click.UsageError("give both --key and --body, or neither (to read JSON lines)")
    if key is not None and source is not None:
        raise click.UsageError("give --key/--body or --from, not both")
    lines: Iterator[Line | str]
    if key is not None and body is not None:
        lines = iter([Line(1, key, body.encode(), None, None)])
    else:
        lines = parse_lines(source or sys.stdin)
    settings = ctx.settings
    invalid = 0
    failed = 0
    futures: list[tuple[int, Future[Receipt]]] = []
    started = time.monotonic()
    with Producer(
        name, amqp_url=settings.amqp, etcd=ctx.registry(), partitions=partitions, window=window
    ) as producer:
        for line in lines:
            if isinstance(line, str):
                invalid += 1
                click.echo(f"partq: skipped {line}", err=True)
                continue
            futures.append(
                (
                    line.number,
                    producer.publish(
                        line.key, line.body, headers=line.headers, message_id=line.message_id
                    ),
                )
            )
        producer.flush(timeout=None)
    for number, future in futures:
        error = future.exception()
        if error is not None:
            failed += 1
            click.echo(f"partq: line {number} failed: {error}", err=True)
    elapsed = time.monotonic() - started
    confirmed = len(futures) - failed
    rate = confirmed / elapsed if elapsed > 0 else 0.0
    click.echo(
        f"sent {len(futures)}, confirmed {confirmed}, failed {failed}, invalid {invalid}, "
        f"{elapsed:.2f}s, {rate:,.0f} msg/s"
    )
    if failed or invalid:
        raise click.exceptions.Exit(1)
