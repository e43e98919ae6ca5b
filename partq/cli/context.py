"""What every subcommand gets: settings, built lazily so ``--help`` needs no servers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import click

from partq.kernel.settings import Settings
from partq.producer.registry import Registry


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
