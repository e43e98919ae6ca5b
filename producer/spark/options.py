"""The sink's options, parsed and validated once, and how the stream spec is found.

Spark hands a data source its options as a case-insensitive ``str → str``
mapping; :meth:`SinkOptions.from_options` turns that into a frozen value and
fails with a message naming the option when one is wrong.

**The spec reader.** The default (:data:`DEFAULT_SPEC_READER`,
``partq.producer.registry.read_spec_from_endpoints``) reads the spec from etcd. Option
``specReader`` names any other ``"module:function"`` taking ``(stream,
endpoints)`` and returning a ``StreamSpec`` (a test double, another registry); it
is resolved with :mod:`importlib` in whichever Spark process needs it.

**When the spec is read.** Spark calls the data source's ``streamWriter()``
in a driver-side Python worker when it plans each micro-batch and again
before committing it, so a sink given only ``etcdEndpoints`` reads the spec
(a few milliseconds) then. :meth:`SinkOptions.pinned` reads it once in the
driver and passes it as option ``spec``; the sink then keeps publishing while
etcd is down. ``partq spark-job`` always pins.

**Resizes** (docs/resize.md). Each micro-batch publishes under the newest layout
(:meth:`SinkOptions.current_spec`: a pinned spec is a fallback that a newer epoch in etcd
replaces). A task that publishes while a resize cuts its layout gets its messages returned
by the broker; its producer then reads etcd (:class:`TaskSpecs`, read only then: tasks do
not watch) for the newer layout and republishes them in order.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from partq.producer.contract import StreamSpec, validate_stream_name

from partq.kernel.amqp import DEFAULT_AMQP_URL, AmqpTarget, AmqpTLS, AmqpURL, redact_url
from partq.kernel.errors import PartqError, SpecMismatch, UsageError
from partq.kernel.settings import Settings

__all__ = [
    "DEFAULT_SPEC_READER",
    "SinkOptions",
    "SpecReader",
    "TaskSpecs",
    "read_spec",
    "resolve_spec_reader",
]

log = logging.getLogger("partq.spark")

DEFAULT_SPEC_READER = "partq.producer.registry:read_spec_from_endpoints"

# A pinned query's per-batch read of the newest layout: after an etcd that did not answer
# (which may take its whole timeout), this process asks it again only after _ASK_AGAIN s.
_ASK_AGAIN = 30.0
_unanswered: dict[tuple[str, str], float] = {}  # (endpoints, reader) -> monotonic deadline
_newest: dict[str, StreamSpec] = {}  # stream -> the newest layout this process read

SpecReader = Callable[[str, str], StreamSpec]

# Python field -> Spark option name (Spark compares option names case-insensitively).
_NAMES = {
    "stream": "stream",
    "key_column": "keyColumn",
    "value_column": "valueColumn",
    "headers_column": "headersColumn",
    "order_column": "orderColumn",
    "etcd_endpoints": "etcdEndpoints",
    "amqp_url": "amqpUrl",
    "partitions": "partitions",
    "window": "window",
    "spec_reader": "specReader",
    "spec": "spec",
    "query_id": "queryId",
    "confirm_timeout": "confirmTimeout",
}
# AmqpTLS field -> Spark option name: an amqpUrl's TLS settings travel next to it
_TLS_NAMES = {
    "ca": "amqpCa",
    "cert": "amqpCert",
    "key": "amqpKey",
    "external_auth": "amqpExternalAuth",
}


def _amqp_target(url: str | None, given: Mapping[str, str]) -> AmqpTarget:
    """``amqpUrl`` with the ``amqpCa``/``amqpCert``/``amqpKey``/``amqpExternalAuth`` options;
    without ``amqpUrl``, the settings' (PARTQ_* environment, PARTQ_CONFIG)."""
    if url is None:
        return Settings.load().amqp
    tls = {
        field_name: given.get(option.lower()) or None for field_name, option in _TLS_NAMES.items()
    }
    return AmqpTarget(
        url,
        AmqpTLS(
            ca=Path(tls["ca"]) if tls["ca"] else None,
            cert=Path(tls["cert"]) if tls["cert"] else None,
            key=Path(tls["key"]) if tls["key"] else None,
            external_auth=(tls["external_auth"] or "").lower() == "true",
        ),
    )


@dataclass(frozen=True)
class SinkOptions:
    """Everything the ``partq`` sink is told; see the README for each option."""

    stream: str
    key_column: str
    value_column: str | None = None
    headers_column: str | None = None
    order_column: str | None = None
    etcd_endpoints: str = ""  # empty: the reader's default (PARTQ_ETCD_ENDPOINTS or localhost)
    amqp_url: AmqpURL = field(default=DEFAULT_AMQP_URL, repr=False)
    partitions: int | None = None
    window: int = 1000
    spec_reader: str = DEFAULT_SPEC_READER
    spec: str | None = None  # a pinned StreamSpec as JSON
    query_id: str | None = None
    confirm_timeout: float = 120.0

    def __post_init__(self) -> None:
        validate_stream_name(self.stream)
        if not self.key_column:
            raise UsageError("option keyColumn is required: the column holding each row's key")
        if self.window < 1:
            raise UsageError(f"option window must be at least 1, got {self.window}")
        if self.partitions is not None and self.partitions < 1:
            raise UsageError(f"option partitions must be at least 1, got {self.partitions}")
        if self.confirm_timeout <= 0:
            raise UsageError(f"option confirmTimeout must be positive, got {self.confirm_timeout}")
        if self.query_id is not None and (not self.query_id or ":" in self.query_id):
            raise UsageError(f"option queryId must be non-empty without ':', got {self.query_id!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> SinkOptions:
        given = {name.lower(): value for name, value in options.items()}

        def text(field_name: str) -> str | None:
            value = given.get(_NAMES[field_name].lower())
            return value if value not in (None, "") else None

        def number(field_name: str, kind: Callable[[str], float | int]) -> float | int | None:
            raw = text(field_name)
            if raw is None:
                return None
            try:
                return kind(raw)
            except ValueError:
                raise UsageError(
                    f"option {_NAMES[field_name]} must be a number, got {raw!r}"
                ) from None

        stream, key_column = text("stream"), text("key_column")
        if stream is None:
            raise UsageError('option stream is required: .option("stream", "orders")')
        if key_column is None:
            raise UsageError('option keyColumn is required: .option("keyColumn", "user_id")')
        partitions = number("partitions", int)
        window = number("window", int)
        confirm_timeout = number("confirm_timeout", float)
        return cls(
            stream=stream,
            key_column=key_column,
            value_column=text("value_column"),
            headers_column=text("headers_column"),
            order_column=text("order_column"),
            etcd_endpoints=text("etcd_endpoints") or "",
            amqp_url=_amqp_target(text("amqp_url"), given),
            partitions=None if partitions is None else int(partitions),
            window=1000 if window is None else int(window),
            spec_reader=text("spec_reader") or DEFAULT_SPEC_READER,
            spec=text("spec"),
            query_id=text("query_id"),
            confirm_timeout=120.0 if confirm_timeout is None else float(confirm_timeout),
        )

    def to_options(self) -> dict[str, str]:
        """The Spark options that :meth:`from_options` turns back into these options."""
        options: dict[str, str] = {}
        for field_name, option in _NAMES.items():
            value = getattr(self, field_name)
            if isinstance(value, AmqpTarget):
                for tls_field, tls_option in _TLS_NAMES.items():
                    if (setting := getattr(value.tls, tls_field)) not in (None, False):
                        options[tls_option] = (
                            str(setting).lower() if setting is True else str(setting)
                        )
                value = value.url  # str() of a target hides the password
            if value is not None and value != "":
                options[option] = str(value)
        return options

    def read_spec(self) -> StreamSpec:
        """The stream's spec (pinned, or read now), checked against ``partitions``."""
        spec = self._pinned() if self.spec is not None else self._read()
        self._check_partitions(spec)
        return spec

    def current_spec(self) -> StreamSpec:
        """The layout one micro-batch publishes under: read from etcd now; with a pinned
        spec, the pinned one unless etcd answers with a newer epoch (a resize since the
        pin), so a pinned query keeps publishing while etcd is away. ``partitions`` is
        checked against a stream never resized (a resized one may have grown or shrunk
        under a running query: ``RowLayout.from_schema`` checks the count the query
        grouped its rows by)."""
        spec = self._read() if self.spec is None else self._pinned_or_newer()
        if spec.epoch == 0:
            self._check_partitions(spec)
        return spec

    def _pinned_or_newer(self) -> StreamSpec:
        """The pinned spec, or a newer one read now or before by this process; etcd is not
        asked for ``_ASK_AGAIN`` s after it did not answer."""
        spec = self._pinned()
        seen = _newest.get(spec.name)
        spec = seen if seen is not None and seen.epoch > spec.epoch else spec
        where = (self.etcd_endpoints, self.spec_reader)
        if time.monotonic() < _unanswered.get(where, 0.0):
            return spec
        try:
            newest = self._read()
        except PartqError as e:
            _unanswered[where] = time.monotonic() + _ASK_AGAIN
            log.warning(
                "stream %s: publishing under the pinned layout; etcd is asked again in %.0fs (%s)",
                self.stream,
                _ASK_AGAIN,
                e,
            )
            return spec
        if newest.epoch > spec.epoch:
            spec = _newest[spec.name] = newest
        return spec

    def _read(self) -> StreamSpec:
        return read_spec(self.stream, self.etcd_endpoints, self.spec_reader)

    def _pinned(self) -> StreamSpec:
        assert self.spec is not None
        try:
            spec = StreamSpec.from_json(self.spec)
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"option spec is not a partq stream spec ({e})") from None
        if spec.name != self.stream:
            raise UsageError(f"option spec describes stream {spec.name!r}, not {self.stream!r}")
        return spec

    def _check_partitions(self, spec: StreamSpec) -> None:
        if self.partitions is not None and self.partitions != spec.partitions:
            raise SpecMismatch(
                f"stream {spec.name!r} has {spec.partitions} partitions in etcd, but option "
                f"partitions={self.partitions} expects {self.partitions}: fix the option "
                f"(a count changes only by `partq stream resize`); nothing was published"
            )

    def pinned(self) -> SinkOptions:
        """These options with the spec read now (once) and carried along as option ``spec``."""
        return replace(self, spec=self.read_spec().to_json())

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}" for name in _NAMES if name not in ("amqp_url", "spec")
        )
        return f"SinkOptions({shown}, amqp_url={redact_url(self.amqp_url)!r})"


class TaskSpecs:
    """How a task's producer follows a resize (``partq.producer.follow.SpecWatcher``): it reads
    etcd only once the broker returned a publish, and never watches (a task publishes for
    seconds, and a resize is rare). The producer then reads the spec at once, and every
    second while a resize runs, for at most its ``layout_timeout``."""

    def __init__(self, options: SinkOptions) -> None:
        self._options = options

    def read_spec(self, stream: str) -> StreamSpec:
        return read_spec(stream, self._options.etcd_endpoints, self._options.spec_reader)

    def read_resize(self, stream: str) -> bytes | None:
        if self._options.spec_reader != DEFAULT_SPEC_READER:
            # cannot tell: the producer waits its layout_timeout for a newer spec
            raise PartqError(f"specReader {self._options.spec_reader!r} reads no resize record")
        from partq.producer.registry import read_resize_from_endpoints

        return read_resize_from_endpoints(stream, self._options.etcd_endpoints)

    def watch_spec(self, stream: str, on_spec: Callable[[StreamSpec | None], None]) -> int:
        return 0  # no watch: the producer reads the spec while it waits

    def cancel_watch(self, watch_id: int) -> None:
        pass


def resolve_spec_reader(path: str) -> SpecReader:
    """The function named ``"package.module:function"``."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UsageError(
            f"option specReader must look like 'package.module:function', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(
            f"option specReader {path!r}: cannot import {module_name} ({e}); is partq installed "
            f"in the Python that Spark runs (PYSPARK_PYTHON)?"
        ) from None
    reader = getattr(module, attribute, None)
    if not callable(reader):
        raise UsageError(f"option specReader {path!r}: {module_name} has no function {attribute}")
    return reader  # type: ignore[no-any-return]


def read_spec(
    stream: str, etcd_endpoints: str, spec_reader: str = DEFAULT_SPEC_READER
) -> StreamSpec:
    """Read ``stream``'s spec with the reader named ``spec_reader``."""
    spec = resolve_spec_reader(spec_reader)(stream, etcd_endpoints)
    if not isinstance(spec, StreamSpec):
        raise UsageError(
            f"option specReader {spec_reader!r} returned {type(spec).__name__}, not a StreamSpec"
        )
    return spec
