"""``prepare(df, spec, key_column)``: give each partq partition to one task, in order.

A DataFrame reaches a sink in whatever partitioning the query made, so the
sink cannot promise per-key order by itself. ``prepare`` adds

* ``_partq_partition`` — ``partq.producer.contract.partition_for(key, P)``, the very
  function every partq producer uses, run as a Python UDF (Spark's own
  ``hash()`` is a different function); its metadata records P, the count the
  rows are grouped by, which a running query keeps across a resize (the sink
  then routes each key by the current layout);
* ``_partq_position`` — the row's place in the source: the source task's index
  shifted left 33 bits plus the row's index within that task, so sorting by it
  restores source order after the shuffle mixed tasks' rows;

and moves each row to task ``partition % n`` of ``n = min(tasks, P)``
(``repartitionById``, Spark ≥ 4.1), so all rows of a partition land in one task
and every task gets the same number of partitions. Hash-repartitioning the
small integers 0 … P-1 instead spread 8 partitions over 4 tasks as 0/1/3/4 in a
benchmark, adaptive execution then coalesced a static DataFrame into a single
task, and range-repartitioning reads the source twice per batch to sample it
(which also doubles the batch's ``numInputRows``). On Spark 4.0 ``prepare``
falls back to hash-repartitioning.

Then rows are put in order within each partition: by the order column when
one is given, ties and the rest by source position. Spark refuses to sort a
*streaming* DataFrame (even ``sortWithinPartitions``), so for a stream
``prepare`` only records the order column as ``_partq_order`` and the sink
sorts each task's rows itself; a static DataFrame (as in ``foreachBatch``) is
sorted by Spark, which can spill to disk.

Only Python UDFs are used (no ``mapInArrow``/pandas UDFs, which need pandas,
and no ``monotonically_increasing_id``, which Spark refuses on streams).
"""

from __future__ import annotations

from dataclasses import dataclass

from partq.producer.contract import StreamSpec, partition_for
from partq.producer.spark.rows import GROUPED_BY, ORDER_COLUMN, PARTITION_COLUMN, POSITION_COLUMN
from pyspark import TaskContext
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType

from partq.kernel.errors import UsageError

__all__ = ["prepare"]

_TASK_SHIFT = 33  # as Spark's monotonically_increasing_id: 2**33 rows per task


@dataclass(frozen=True)
class _PartitionOf:
    """The UDF body: a row's partq partition (picklable, so executors get the same code)."""

    partitions: int
    column: str

    def __call__(self, key: str | bytes | bytearray | None) -> int:
        if key is None:
            raise UsageError(
                f"key column {self.column!r} is null in a row: partq needs a key for every "
                f"message; filter or fill such rows before prepare()"
            )
        return partition_for(bytes(key) if isinstance(key, bytearray) else key, self.partitions)


class _SourcePosition:
    """The UDF body: ``(task << 33) + n`` for the task's n-th row.

    A Python UDF sees a task's rows one by one, in order, in one worker; the
    counter restarts whenever a new task attempt starts, so the same input split
    always gives the same positions (what makes replayed message ids equal).
    """

    __slots__ = ("_next", "_task")

    def __init__(self) -> None:
        self._task = -1
        self._next = 0

    def __call__(self) -> int:
        context = TaskContext.get()
        if context is None:
            raise RuntimeError("_partq_position can only be computed inside a Spark task")
        attempt = context.taskAttemptId()
        if attempt != self._task:
            self._task, self._next = attempt, 0
        position = (context.partitionId() << _TASK_SHIFT) + self._next
        self._next += 1
        return position

    def __reduce__(self) -> tuple[type[_SourcePosition], tuple[()]]:
        return (_SourcePosition, ())  # every executor starts with a fresh counter


def _partition_column(key_column: str, partitions: int) -> Column:
    udf = F.udf(_PartitionOf(partitions, key_column), IntegerType(), useArrow=False)
    return udf(F.col(key_column))


def _position_column() -> Column:
    udf = F.udf(_SourcePosition(), LongType(), useArrow=False).asNondeterministic()
    return udf()


def prepare(
    df: DataFrame,
    spec_or_partitions: StreamSpec | int,
    key_column: str,
    order_column: str | None = None,
    *,
    num_tasks: int | None = None,
) -> DataFrame:
    """``df`` with partq's partition and source position, one task per partition, ordered.

    ``num_tasks`` is how many Spark tasks publish (default
    ``spark.sql.shuffle.partitions``, at most P); each gets every row of some
    partitions.
    Do not repartition the result: the sink refuses a batch whose partition
    was published by two tasks.
    """
    partitions = (
        spec_or_partitions.partitions
        if isinstance(spec_or_partitions, StreamSpec)
        else spec_or_partitions
    )
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise UsageError(f"prepare() needs a StreamSpec or a partition count, got {partitions!r}")
    names = df.schema.fieldNames()
    for column, what in ((key_column, "key column"), (order_column, "order column")):
        if column is not None and column not in names:
            raise UsageError(f"{what} {column!r} is not a column of the DataFrame ({names})")
    key_type = df.schema[key_column].dataType
    if not isinstance(key_type, StringType | BinaryType):
        raise UsageError(
            f"key column {key_column!r} is {key_type.simpleString()}: keys must be string or "
            f"binary so every language hashes the same bytes (cast it to string first)"
        )
    prepared = df.withColumn(
        PARTITION_COLUMN, _partition_column(key_column, partitions)
    ).withMetadata(PARTITION_COLUMN, {GROUPED_BY: partitions})
    prepared = prepared.withColumn(POSITION_COLUMN, _position_column())
    if df.isStreaming and order_column is not None:
        prepared = prepared.withColumn(ORDER_COLUMN, F.col(order_column))
    tasks = num_tasks or int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or 200)
    tasks = min(tasks, partitions)
    if hasattr(prepared, "repartitionById"):  # Spark >= 4.1: partition p -> task p % tasks
        prepared = prepared.repartitionById(tasks, PARTITION_COLUMN)
    else:
        prepared = prepared.repartition(tasks, PARTITION_COLUMN)
    if df.isStreaming:
        return prepared
    order = [PARTITION_COLUMN, *([order_column] if order_column else []), POSITION_COLUMN]
    return prepared.sortWithinPartitions(*order)
