"""Every address partq serves on defaults to loopback: the daemons' ``--http-host`` and the
Spark job's ``--metrics-addr`` alike (docs/security.md, Binding)."""

from __future__ import annotations

from collections.abc import Iterator

import click

from partq.cli import cli
from partq.cli.web import LOOPBACK

ADDRESS_SUFFIXES = ("_host", "_addr", "_address", "_bind")


def commands(group: click.Group, prefix: str = "partq") -> Iterator[tuple[str, click.Command]]:
    for name, command in sorted(group.commands.items()):
        path = f"{prefix} {name}"
        yield path, command
        if isinstance(command, click.Group):
            yield from commands(command, path)


def test_every_listening_address_defaults_to_loopback() -> None:
    addresses = {
        f"{path} {param.opts[0]}": param.default
        for path, command in commands(cli)
        for param in command.params
        if isinstance(param, click.Option) and (param.name or "").endswith(ADDRESS_SUFFIXES)
    }
    assert {"partq consume --http-host", "partq spark-job --metrics-addr"} <= set(addresses)
    assert {flag: default for flag, default in addresses.items() if default != LOOPBACK} == {}
