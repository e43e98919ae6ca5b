"""``partq produce NAME``: publish one message, or JSON lines from a file or stdin."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any

import click

from partq.cli.context import Context, expected_partitions, pass_context
from partq.cli.web import base_url, http_options, serve_http, server_context
from partq.kernel.errors import PartqError, UsageError
from partq.kernel.terminal import printable
from partq.producer.contract import refuse_control_headers
from partq.producer.ledger import Receipt
from partq.producer.properties import encode_properties, message_properties
from partq.producer.publisher import Producer


@dataclass(frozen=True)
class Line:
    number: int
    key: str
    body: bytes
    headers: dict[str, Any] | None
    message_id: str | None


def parse_lines(stream: IO[str], *, check: bool = True) -> Iterator[Line | str]:
    """Yield a :class:`Line` per valid JSON line, or an error text naming the line.

    A valid line is one the producer can send: its key and body are text, its headers
    and message id are what AMQP carries (:func:`problem`). ``check`` False: the lines
    were checked already (a file read again after :func:`_check_whole`), so only what
    the producer does not check again is."""
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        column, byte = _undecoded(raw)
        if byte is not None:
            yield (
                f"line {number}: not UTF-8 (byte 0x{byte:02x} at column {column}); "
                "save the file as UTF-8"
            )
            continue
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            yield f'line {number}: not JSON ({e.msg}); expected {{"key": ..., "body": ...}}'
            continue
        except RecursionError:
            yield f"line {number}: JSON nested too deeply for this parser; flatten it"
            continue
        if not isinstance(doc, dict) or "key" not in doc or "body" not in doc:
            yield f'line {number}: expected an object with "key" and "body"'
            continue
        key, body = doc["key"], doc["body"]
        if not isinstance(key, str):
            yield f'line {number}: "key" must be a string, got {type(key).__name__}'
            continue
        headers = doc.get("headers")
        if headers is not None and not isinstance(headers, dict):
            yield f'line {number}: "headers" must be an object'
            continue
        message_id = doc.get("message_id")
        try:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        except UnicodeEncodeError:
            yield f'line {number}: "body" is not valid UTF-8 text (it holds a lone surrogate)'
            continue
        except RecursionError:
            yield f"line {number}: JSON nested too deeply for this parser; flatten it"
            continue
        line = Line(number, key, data, headers, None if message_id is None else str(message_id))
        wrong = problem(line) if check else None
        if wrong is not None:
            yield f"line {number}: {wrong}"
            continue
        yield line


def _undecoded(raw: str) -> tuple[int, int | None]:
    """The 1-based column and value of the first byte of ``raw`` that was not UTF-8, kept
    by :data:`SOURCE`'s ``surrogateescape`` as a lone surrogate U+DC80..U+DCFF; (0, None)
    if none."""
    for column, char in enumerate(raw, start=1):
        if "\udc80" <= char <= "\udcff":
            return column, ord(char) - 0xDC00
    return 0, None


def problem(line: Line) -> str | None:
    """What stops the producer from sending ``line`` (its body aside), or None. The one
    check the producer makes at publish time too, made here before anything is sent."""
    try:
        line.key.encode("utf-8")
    except UnicodeEncodeError:
        return '"key" is not valid UTF-8 text (it holds a lone surrogate)'
    try:
        refuse_control_headers(line.headers)
    except UsageError as e:
        return str(e)
    properties = message_properties(
        line.key, 0, message_id=line.message_id, headers=line.headers, now=0.0
    )
    try:
        encode_properties(properties, sys.maxsize)  # the size limit is the broker's: later
    except UsageError as e:
        return str(e).removeprefix("cannot publish this message: ")
    return None


_SHOWN = 10  # invalid line numbers named in one error, at most
# --from: UTF-8, a byte that is not kept (as a lone surrogate) for parse_lines to name its
# line, rather than a UnicodeDecodeError ending the reading at no line.
SOURCE = click.File("r", encoding="utf-8", errors="surrogateescape")
log = logging.getLogger("partq.cli")


@click.command()
@click.argument("name")
@click.option("--key", "-k", help="Key of a single message.")
@click.option("--body", "-b", help="Body of a single message.")
@click.option(
    "--from",
    "source",
    type=SOURCE,
    help='JSON lines {"key": …, "body": …} (\'-\' = stdin; the default without --key). '
    "A file is checked whole before anything is sent; from stdin, lines are sent as read.",
)
@click.option(
    "--skip-invalid",
    is_flag=True,
    help="Send the valid lines, report the invalid ones (exit 1) [default: send nothing "
    "from a file with an invalid line; stop at one from stdin].",
)
@expected_partitions
@click.option(
    "--window",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Unconfirmed messages in flight at most.",
)
@http_options(default_port=None)
@pass_context
def produce(
    ctx: Context,
    name: str,
    key: str | None,
    body: str | None,
    source: IO[str] | None,
    skip_invalid: bool,
    partitions: int | None,
    window: int,
    http_host: str,
    http_port: int | None,
) -> None:
    """Publish keyed messages to stream NAME and print a summary.

    With --http-port, serves /metrics (the partq_producer_* series), /livez and /readyz
    while it publishes: for a long-running producer reading stdin.
    """
    lines = _lines(key, body, source, skip_invalid)
    settings = ctx.settings
    if http_port is not None:
        server_context(settings.http)  # a certificate that cannot be used: exit 2 first
    started = time.monotonic()
    with Producer(
        name, amqp_url=settings.amqp, etcd=ctx.registry(), partitions=partitions, window=window
    ) as producer:
        if http_port is not None:
            server = serve_http(http_host, http_port, settings.http, live=_always, ready=_always)
            log.info("producer metrics on %s/metrics", base_url(http_host, server, settings.http))
        futures, invalid, stopped = _publish_all(producer, lines, skip_invalid)
        producer.flush(timeout=None)
    if http_port is not None:
        server.shutdown()
    _summarize(futures, invalid, stopped, time.monotonic() - started)


def _lines(
    key: str | None, body: str | None, source: IO[str] | None, skip_invalid: bool
) -> Iterator[Line | str]:
    """The messages to send: the one of --key and --body, or JSON lines (a bad one as its
    problem, a str); refused at once when a seekable file holds a bad line."""
    if (key is None) != (body is None):
        raise click.UsageError("give both --key and --body, or neither (to read JSON lines)")
    if key is not None and source is not None:
        raise click.UsageError("give --key/--body or --from, not both")
    if key is not None and body is not None:
        single = Line(1, key, body.encode("utf-8", "surrogateescape"), None, None)
        wrong = problem(single)
        if wrong is not None:
            raise UsageError(f"--key: {wrong}")
        return iter([single])
    source = source or sys.stdin
    if source is None:  # started with stdin closed
        raise UsageError("stdin is closed: give --from FILE, or --key and --body")
    if not skip_invalid and _seekable(source):
        _check_whole(source)
        return parse_lines(source, check=False)
    return parse_lines(source)


def _publish_all(
    producer: Producer, lines: Iterator[Line | str], skip_invalid: bool
) -> tuple[list[tuple[int, Future[Receipt]]], int, str | None]:
    """Publish each line: the futures by line number, the invalid lines, and the problem
    that stopped it (None: it went to the end)."""
    futures: list[tuple[int, Future[Receipt]]] = []
    invalid = 0
    for line in lines:
        if isinstance(line, str):
            invalid += 1
            if not skip_invalid:
                return futures, invalid, line
            click.echo(f"partq: skipped {printable(line)}", err=True)
            continue
        try:
            future = producer.publish(
                line.key, line.body, headers=line.headers, message_id=line.message_id
            )
        except (PartqError, TypeError) as e:  # a message this broker's frame cannot carry
            return futures, invalid + 1, f"line {line.number}: {e}"
        futures.append((line.number, future))
    return futures, invalid, None


def _summarize(
    futures: list[tuple[int, Future[Receipt]]], invalid: int, stopped: str | None, elapsed: float
) -> None:
    """Say what failed and the totals; raise (exit 1 or 2) unless every line was sent."""
    failed = 0
    for number, result in futures:
        error = result.exception()
        if error is not None:
            failed += 1
            click.echo(f"partq: line {number} failed: {printable(str(error))}", err=True)
    confirmed = len(futures) - failed
    rate = confirmed / elapsed if elapsed > 0 else 0.0
    click.echo(
        f"sent {len(futures)}, confirmed {confirmed}, failed {failed}, invalid {invalid}, "
        f"{elapsed:.2f}s, {rate:,.0f} msg/s"
    )
    if stopped is not None:
        raise UsageError(
            f"{stopped}; stopped there: the {len(futures)} lines before it were sent "
            f"({confirmed} confirmed): fix it and send from it on, or add --skip-invalid"
        )
    if failed or invalid:
        raise click.exceptions.Exit(1)


def _always() -> bool:
    """A producer is live and ready while it runs: it connected before its port opened."""
    return True


def _seekable(source: IO[str]) -> bool:
    try:
        return source.seekable()
    except (OSError, ValueError):
        return False


def _check_whole(source: IO[str]) -> None:
    """Refuse a file with an invalid line before anything is sent (then rewind it)."""
    bad = [line for line in parse_lines(source) if isinstance(line, str)]
    if bad:
        numbers = [text.split(":", 1)[0].removeprefix("line ") for text in bad]
        shown = ", ".join(numbers[:_SHOWN]) + (", …" if len(numbers) > _SHOWN else "")
        raise UsageError(
            f"{bad[0]}; {len(bad)} invalid lines in all (lines {shown}): nothing sent: "
            f"fix them, or add --skip-invalid to send the valid ones"
        )
    source.seek(0)
