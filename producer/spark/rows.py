"""From a Spark row to a partq message: where the key, body and headers come from.

:class:`RowLayout` is built once from the DataFrame's schema and the sink's
options, validating both (with messages that say what to do), and then turns
each row into a :class:`Outgoing` message and a sort key. Rows are read by
position, not by name, because that is what a task does a million times.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partq.producer.contract import StreamSpec, partition_for
from partq.producer.spark.options import SinkOptions
from pyspark.sql import Row
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
)

from partq.kernel.errors import SpecMismatch, UsageError

__all__ = [
    "GROUPED_BY",
    "INTERNAL_PREFIX",
    "ORDER_COLUMN",
    "PARTITION_COLUMN",
    "POSITION_COLUMN",
    "Outgoing",
    "RowLayout",
]

INTERNAL_PREFIX = "_partq_"
PARTITION_COLUMN = "_partq_partition"  # partition_for(key, P), added by prepare()
GROUPED_BY = "partq.partitions"  # PARTITION_COLUMN's metadata: the P prepare() hashed by
POSITION_COLUMN = "_partq_position"  # source order: (source task << 33) + row index in it
ORDER_COLUMN = "_partq_order"  # a copy of prepare()'s order column on streaming DataFrames

_PREPARE_HINT = (
    "call partq.producer.spark.prepare(df, spec, key_column) before "
    "df.writeStream.format('partq'): "
    "it computes each row's partition with partq's hash and gives every partition to one task"
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish."""

    partition: int
    key: str | bytes
    body: bytes
    headers: dict[str, str] | None


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _plain(value: Any) -> Any:
    """Nested rows as objects (a ``Row`` is a tuple, which JSON would make a list)."""
    if isinstance(value, Row):
        return {name: _plain(item) for name, item in value.asDict().items()}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _is_complex(data_type: DataType) -> bool:
    return isinstance(data_type, StructType | ArrayType | MapType)


def _index(schema: StructType, column: str, what: str) -> int:
    names = schema.fieldNames()
    if column not in names:
        raise UsageError(f"{what} {column!r} is not a column of the DataFrame (columns: {names})")
    return names.index(column)


def _grouped_by(schema: StructType, options: SinkOptions, spec: StreamSpec) -> int:
    """The partition count ``prepare()`` grouped the rows by (its column's metadata; the
    spec's count for a column without it), checked against the stream.

    A query keeps its grouping for its life, while a resize (docs/resize.md) may change
    the stream's count under it: each key is still in one task, in order, and the task's
    producer routes it by the current layout. So a resized stream (epoch above 0) takes
    any grouping; a stream never resized, only its own count."""
    metadata = schema[PARTITION_COLUMN].metadata or {}
    grouped = metadata.get(GROUPED_BY, spec.partitions)
    if not isinstance(grouped, int) or isinstance(grouped, bool) or grouped < 1:
        raise UsageError(f"column {PARTITION_COLUMN} has malformed metadata: {_PREPARE_HINT}")
    if options.partitions is not None and grouped != options.partitions:
        raise SpecMismatch(
            f"prepare() grouped the rows by {grouped} partitions, but option "
            f"partitions={options.partitions} expects {options.partitions}: pass prepare() "
            f"the stream's spec, and fix the option"
        )
    if spec.epoch == 0 and grouped != spec.partitions:
        raise SpecMismatch(
            f"prepare() grouped the rows by {grouped} partitions, but stream {spec.name!r} "
            f"has {spec.partitions}: pass prepare() the stream's spec; nothing was published"
        )
    return grouped


@dataclass(frozen=True)
class RowLayout:
    """Where each part of a message is in a row, checked against the schema."""

    partitions: int
    key: int
    partition: int
    position: int
    order: int | None
    value: int | None
    headers: int | None
    payload: tuple[tuple[str, int, bool], ...]  # JSON body: (name, index, needs _plain)

    @classmethod
    def from_schema(cls, schema: StructType, options: SinkOptions, spec: StreamSpec) -> RowLayout:
        fields = schema.fields
        for column, kind, what in (
            (PARTITION_COLUMN, IntegerType, "int"),
            (POSITION_COLUMN, LongType, "bigint"),
        ):
            if column not in schema.fieldNames():
                raise UsageError(f"the DataFrame has no column {column}: {_PREPARE_HINT}")
            if not isinstance(fields[schema.fieldNames().index(column)].dataType, kind):
                raise UsageError(f"column {column} must be {what}: {_PREPARE_HINT}")
        partitions = _grouped_by(schema, options, spec)
        key = _index(schema, options.key_column, "option keyColumn")
        if not isinstance(fields[key].dataType, StringType | BinaryType):
            raise UsageError(
                f"key column {options.key_column!r} is {fields[key].dataType.simpleString()}: "
                f"keys must be string or binary so every language hashes the same bytes "
                f"(cast it, e.g. col({options.key_column!r}).cast('string'))"
            )
        value = None
        if options.value_column is not None:
            value = _index(schema, options.value_column, "option valueColumn")
            if not isinstance(fields[value].dataType, StringType | BinaryType):
                raise UsageError(
                    f"value column {options.value_column!r} is "
                    f"{fields[value].dataType.simpleString()}: it must be string or binary "
                    f"(or leave valueColumn out to send the other columns as JSON)"
                )
        headers = None
        if options.headers_column is not None:
            headers = _index(schema, options.headers_column, "option headersColumn")
            header_type = fields[headers].dataType
            if not (
                isinstance(header_type, MapType)
                and isinstance(header_type.keyType, StringType)
                and isinstance(header_type.valueType, StringType)
            ):
                raise UsageError(
                    f"headers column {options.headers_column!r} is {header_type.simpleString()}: "
                    f"it must be map<string,string>"
                )
        if options.order_column is not None:
            order: int | None = _index(schema, options.order_column, "option orderColumn")
        elif ORDER_COLUMN in schema.fieldNames():
            order = schema.fieldNames().index(ORDER_COLUMN)
        else:
            order = None
        skip = {options.key_column, options.headers_column}
        payload = tuple(
            (f.name, i, _is_complex(f.dataType))
            for i, f in enumerate(fields)
            if f.name not in skip and not f.name.startswith(INTERNAL_PREFIX)
        )
        names = schema.fieldNames()
        return cls(
            partitions=partitions,
            key=key,
            partition=names.index(PARTITION_COLUMN),
            position=names.index(POSITION_COLUMN),
            order=order,
            value=value,
            headers=headers,
            payload=payload,
        )

    def sort_key(self, row: Sequence[Any]) -> tuple[Any, ...]:
        """(partition, order value with nulls first as Spark sorts, source position)."""
        if self.order is None:
            return (row[self.partition], row[self.position])
        value = row[self.order]
        return (row[self.partition], value is not None, value, row[self.position])

    def message(self, row: Sequence[Any]) -> Outgoing:
        """The message for ``row``, its partition checked. A null value is an empty body."""
        key = row[self.key]
        if key is None:
            raise UsageError("a row has a null key: filter such rows out before the sink")
        if isinstance(key, bytearray):
            key = bytes(key)
        if self.value is not None:
            raw = row[self.value]
            body = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw or b"")
        else:
            document = {
                name: _plain(row[i]) if nested else row[i] for name, i, nested in self.payload
            }
            body = json.dumps(
                document, default=_json_default, ensure_ascii=False, separators=(",", ":")
            ).encode("utf-8")
        partition = row[self.partition]
        if partition != partition_for(key, self.partitions):
            raise SpecMismatch(
                f"a row's {PARTITION_COLUMN} is {partition} but partq's hash puts its key in "
                f"partition {partition_for(key, self.partitions)} of {self.partitions}: prepare() "
                f"was given another partition count than the stream has: pass it the stream's spec"
            )
        headers = None
        if self.headers is not None and row[self.headers]:
            headers = {k: v for k, v in row[self.headers].items() if v is not None}
        return Outgoing(partition, key, body, headers)
