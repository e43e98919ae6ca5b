"""What every subcommand gets: settings, built lazily so ``--help`` needs no servers."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import click

from partq.kernel.errors import UsageError
from partq.kernel.settings import Settings
from partq.producer.contract import DEFAULT_GROUP, group_scope, split_scope
from partq.producer.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Context:
    config: Path | None
    overrides: dict[str, Any]
    debug: bool = False
    _registry: Registry | None = field(default=None, repr=False)

    @cached_property
    def settings(self) -> Settings:
        return Settings.load(self.config, **self.overrides)

    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry.connect(self.settings)
        return self._registry


pass_context = click.make_pass_decorator(Context)


class Seconds(click.FloatRange):
    """A duration flag: a finite number of seconds, at least ``min`` (0 by default)."""

    name = "seconds"

    def __init__(self, min: float = 0.0) -> None:
        super().__init__(min=min)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


# consume and produce: the partition count the process expects of the stream's spec
expected_partitions = click.option(
    "--partitions",
    type=click.IntRange(min=1),
    help="Expected partition count; refused if etcd differs.",
)


def scope_of(stream: str, group: str | None) -> str:
    """The scope of ``--group`` of ``stream`` (``STREAM~GROUP`` as the stream names it too)."""
    named, named_group = split_scope(stream)
    if group is None:
        return group_scope(named, named_group)
    if named_group != DEFAULT_GROUP:
        raise UsageError(f"{stream!r} names group {named_group!r} already: drop --group {group}")
    return group_scope(named, group)


def grouped(command: F) -> F:
    """Add ``--group`` to a command taking a ``stream``: the command gets the group's scope
    (:func:`partq.producer.contract.group_scope`) as ``stream``."""

    @click.option(
        "--group",
        default=None,
        help=f"The consumer group [default: {DEFAULT_GROUP}] (partq group create STREAM GROUP).",
    )
    @functools.wraps(command)
    def with_group(*args: Any, stream: str, group: str | None, **kwargs: Any) -> Any:
        return command(*args, stream=scope_of(stream, group), **kwargs)

    return with_group  # type: ignore[return-value]
