"""``partq spark-job``: a Spark Structured Streaming query publishing files (or a rate) to a stream.

Runs until stopped: SIGTERM or SIGINT, at any point after the command starts,
stop the query between writes (or Spark, if it is still starting) and the
command exits 0 after one log line; a failed query exits 1 with the partq error
that failed it.
It reads the stream's spec at start and pins it in the sink's options, so the
running query keeps publishing while etcd is away; each batch takes a newer
layout from etcd when a resize made one (docs/resize.md). Every batch is logged (rows, seconds)
and counted in the ``partq_spark_*`` metrics (``--metrics-port``).

Also runnable with ``spark-submit`` (the master then comes from spark-submit)::

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master 'local[2]' \\
        partq/cli/spark.py --stream orders --source in/ --key-column user_id \\
        --checkpoint chk/

(connection settings from ``PARTQ_ETCD_ENDPOINTS`` / ``PARTQ_AMQP_URL``).
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from partq.cli.context import Context, Seconds, pass_context
from partq.cli.web import LOOPBACK
from partq.kernel.errors import UsageError

if TYPE_CHECKING:
    pass

__all__ = ["spark_job"]

log = logging.getLogger("partq.spark")


def _conf_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--spark-conf")
        conf[key.strip()] = value
    return conf


@click.command("spark-job")
@click.option("--stream", "stream_name", required=True, help="Stream to publish to.")
@click.option(
    "--source",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory Spark watches for new files.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "csv", "parquet"]),
    default="json",
    show_default=True,
    help="Format of the source files (csv: with a header line).",
)
@click.option("--schema", help="Source schema as DDL; default: inferred from the files present.")
@click.option("--rate", type=click.IntRange(1), help="Synthetic source: N rows/s (no --source).")
@click.option(
    "--key-column", help="Column with each row's key (string or binary). Default with --rate: key."
)
@click.option(
    "--value-column",
    help="Column with the body (string or binary); default: the other columns as JSON.",
)
@click.option("--headers-column", help="map<string,string> column of extra headers.")
@click.option(
    "--order-column",
    help="Rows of a key are published in this column's order "
    "(default: source order; with --rate: value).",
)
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Checkpoint directory: restarting with it resumes where the query stopped.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1),
    help="Expected partition count; the job refuses to start if etcd says otherwise.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Unconfirmed messages in flight per task.",
)
@click.option(
    "--trigger-seconds",
    type=Seconds(),
    default=1.0,
    show_default=True,
    help="Seconds between micro-batches (0: as fast as possible).",
)
@click.option("--once", is_flag=True, help="Publish what the source holds now, then exit.")
@click.option(
    "--max-files-per-trigger", type=click.IntRange(1), help="Bound a micro-batch to N new files."
)
@click.option(
    "--num-tasks",
    type=click.IntRange(1),
    help="Spark tasks that publish (default: spark.sql.shuffle.partitions).",
)
@click.option(
    "--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus metrics on this port."
)
@click.option(
    "--metrics-addr",
    default=LOOPBACK,
    show_default=True,
    help="Address for --metrics-port (0.0.0.0 to be scraped from other hosts).",
)
@click.option("--master", help="Spark master [default: local[2]; spark-submit's when run by it].")
@click.option(
    "--spark-conf",
    "spark_conf",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra Spark setting (repeatable).",
)
@pass_context
def spark_job(
    ctx: Context,
    stream_name: str,
    source: Path | None,
    fmt: str,
    schema: str | None,
    rate: int | None,
    key_column: str | None,
    value_column: str | None,
    headers_column: str | None,
    order_column: str | None,
    checkpoint: Path,
    partitions: int | None,
    window: int,
    trigger_seconds: float,
    once: bool,
    max_files_per_trigger: int | None,
    num_tasks: int | None,
    metrics_port: int | None,
    metrics_addr: str,
    master: str | None,
    spark_conf: tuple[str, ...],
) -> None:
    """Publish rows from files in --source (or a --rate) to stream --stream until stopped."""
    from partq.producer.spark.stop import StopSignal  # imports no pyspark: quick

    stop = StopSignal().install()  # from here a signal stops the job, even while Spark starts
    if (source is None) == (rate is None):
        raise click.UsageError("give --source DIR or --rate N (one of them)")
    if rate is not None:
        key_column = key_column or "key"
        order_column = order_column or "value"
    if key_column is None:
        raise click.UsageError("--key-column is required with --source")
    conf = _conf_pairs(spark_conf)
    try:
        from partq.producer.spark import SinkOptions
        from partq.producer.spark.job import run_job
    except ImportError as e:
        raise UsageError(
            f"the Spark job needs the spark extra: pip install 'partq[spark]' ({e})"
        ) from None

    settings = ctx.settings
    registry = ctx.registry()
    try:
        spec = registry.read_spec(stream_name)  # once: the query never reads etcd again
    finally:
        registry.close()
    options = SinkOptions(
        stream=stream_name,
        key_column=key_column,
        value_column=value_column,
        headers_column=headers_column,
        amqp_url=settings.amqp,
        etcd_endpoints=settings.etcd_endpoints,
        partitions=partitions,
        window=window,
        spec=spec.to_json(),
    )
    options.read_spec()  # a wrong --partitions stops here, before Spark starts

    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_addr)
        log.info("metrics on http://%s:%d/metrics", metrics_addr, metrics_port)

    run_job(
        spec,
        options,
        source=source,
        fmt=fmt,
        schema=schema,
        rate=rate,
        key_column=key_column,
        order_column=order_column,
        checkpoint=checkpoint,
        once=once,
        trigger_seconds=trigger_seconds,
        max_files_per_trigger=max_files_per_trigger,
        num_tasks=num_tasks,
        master=master,
        conf=conf,
        stop=stop,
    )


if __name__ == "__main__":  # spark-submit partq/cli/spark.py --stream … (see above)
    # The whole CLI (not just this command) so errors and exit codes are partq's;
    # imported by name because cli imports this module.
    sys.exit(importlib.import_module("partq.cli").main(["spark-job", *sys.argv[1:]]))
