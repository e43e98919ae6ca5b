"""The ``partq`` command: the composition root that wires producer, coordinator and consumers.

Exit codes: 0 ok, 2 usage or validation error, 1 runtime failure. Errors go to
stderr as one line; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import click

from partq.cli.consume import consume
from partq.cli.context import Context
from partq.cli.coordinate import coordinator
from partq.cli.dlq import dlq_group
from partq.cli.groups import group_group
from partq.cli.operate import drain, move, pause, rebalance, resume, status
from partq.cli.produce import produce
from partq.cli.security import security
from partq.cli.spark import spark_job
from partq.cli.streams import stream
from partq.kernel import __version__, logs, terminal
from partq.kernel.amqp import has_password
from partq.kernel.errors import PartqError, exit_code

__all__ = ["cli", "main", "one_line", "report"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="PARTQ_CONFIG",
    help="TOML settings file (flags > PARTQ_* environment > file).",
)
@click.option("--etcd-endpoints", help="Comma-separated etcd URLs [PARTQ_ETCD_ENDPOINTS].")
@click.option("--etcd-user", help="etcd user [PARTQ_ETCD_USER].")
@click.option("--etcd-ca", type=click.Path(path_type=Path), help="etcd CA file [PARTQ_ETCD_CA].")
@click.option(
    "--etcd-cert", type=click.Path(path_type=Path), help="etcd client cert [PARTQ_ETCD_CERT]."
)
@click.option(
    "--etcd-key", type=click.Path(path_type=Path), help="etcd client key [PARTQ_ETCD_KEY]."
)
@click.option(
    "--amqp-url",
    help="RabbitMQ URL, without a password: argv shows in `ps` "
    "[PARTQ_AMQP_URL, PARTQ_AMQP_URL_FILE, PARTQ_AMQP_PASSWORD_FILE].",
)
@click.option(
    "--amqp-ca", type=click.Path(path_type=Path), help="RabbitMQ CA file [PARTQ_AMQP_CA]."
)
@click.option(
    "--amqp-cert",
    type=click.Path(path_type=Path),
    help="RabbitMQ client cert [PARTQ_AMQP_CERT].",
)
@click.option(
    "--amqp-key", type=click.Path(path_type=Path), help="RabbitMQ client key [PARTQ_AMQP_KEY]."
)
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    envvar="PARTQ_LOG_FORMAT",
    help="Logs on stderr as readable text or JSON lines [PARTQ_LOG_FORMAT; default: text on a "
    "terminal, JSON otherwise].",
)
@click.version_option(__version__, prog_name="partq")
@click.pass_context
def cli(
    ctx: click.Context,
    /,
    config: Path | None,
    debug: bool,
    log_format: str | None,
    **overrides: object,
) -> None:
    """partq: keyed, ordered, balanced consumer groups for RabbitMQ, coordinated in etcd.

    Passwords come from the environment, files or the config file, never from flags:
    PARTQ_ETCD_PASSWORD(_FILE), PARTQ_AMQP_PASSWORD_FILE, or inside PARTQ_AMQP_URL(_FILE).
    """
    logs.configure(
        "DEBUG" if debug else "INFO", json=None if log_format is None else log_format == "json"
    )
    url = overrides.get("amqp_url")
    if isinstance(url, str) and has_password(url):
        click.echo(
            "partq: warning: --amqp-url holds a password, which other users can read in `ps`: "
            "set PARTQ_AMQP_URL or PARTQ_AMQP_URL_FILE (or PARTQ_AMQP_PASSWORD_FILE) instead",
            err=True,
        )
    if not debug:  # a failure is partq's one line on stderr, not also the libraries' reports
        for library in logs.QUIET_LIBRARIES:
            logging.getLogger(library).setLevel(logging.CRITICAL)
    ctx.obj = Context(config=config, overrides=overrides, debug=debug)


cli.add_command(stream)
cli.add_command(produce)
cli.add_command(spark_job)
cli.add_command(security)
cli.add_command(dlq_group)
cli.add_command(group_group)
for _command in (consume, coordinator, status, rebalance, move, drain, pause, resume):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        # Without standalone mode click returns (not raises) a command's Exit code.
        code = cli.main(args=argv, prog_name="partq", standalone_mode=False)
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except click.Abort:
        click.echo("partq: aborted", err=True)
        return 130
    except KeyboardInterrupt:
        return 130
    except click.exceptions.NoArgsIsHelpError as e:  # `partq stream`: the help, not an error
        e.show()
        return 2
    except Exception as e:
        if debug:
            traceback.print_exc()
        return report(e)
    return code if isinstance(code, int) else 0


def report(error: Exception) -> int:
    """Print ``error`` as ``partq: error: …`` on one line (and at most one hint line):
    the exit code. A usage error's hint names the command's ``--help``; an error partq
    did not expect says how to see its traceback."""
    hint = None
    if isinstance(error, click.UsageError):
        code = 2
        command = error.ctx.command_path if error.ctx is not None else "partq"
        hint = f"see '{command} --help'"
    elif isinstance(error, click.ClickException):
        code = error.exit_code
    elif isinstance(error, PartqError):
        code = exit_code(error)
    else:
        code = 1
        hint = "an unexpected error: run again with --debug for the traceback, and report it"
    if isinstance(error, click.ClickException):
        text = error.format_message()
    elif isinstance(error, PartqError):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    click.echo(f"partq: error: {one_line(text)}", err=True)
    if hint is not None:
        click.echo(f"partq: hint: {hint}", err=True)
    return code


def one_line(text: str) -> str:
    """``text`` on one printable line (:func:`partq.kernel.terminal.one_line`), never empty."""
    return terminal.one_line(text) or "(no message)"


if __name__ == "__main__":
    sys.exit(main())
