"""``partq spark-job`` publishing keyed sequences while a fault test breaks something.

    with SparkSequences(spec, etcd, "amqp://…,amqp://…", tmp_path / "spark") as job:
        job.wait_publishing()       # two batches committed: the job is past its start-up
        ...                         # the fault
        job.finish()                # stop feeding; every file published and committed
        job.confirmed()             # {(key, seq)} of the committed batches

A feeder thread writes a JSON file whenever at most one waits for the job: ``rows_per_key``
rows for each of ``keys`` keys (``{"key": "spark-007", "seq": n}``, each key's ``seq``
ascending file after file); the job reads one file per micro-batch
(``--max-files-per-trigger 1``), so batch ``b`` publishes file ``b`` and a committed
batch's rows are confirmed. The job runs
in ``local[2,4]`` (a failed task is tried again, as on a cluster, instead of failing the
query) and is given the whole AMQP URL list, so its tasks fail over between nodes. The
consumers' record handler reads ``seq`` from the body, as for the SDK's sequences.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

from partq.producer.contract import StreamSpec
from partq.producer.spark import ReplayId

from examples import audit
from tests.polling import wait_until
from tests.spark.conftest import SPARK_CONF_ARGS, committed_batches, job_process, write_json_rows

__all__ = ["SparkSequences", "handled_twice", "order_apart_from_replays"]

SCHEMA = "key STRING, seq BIGINT"
_RETRIED = re.compile(r"PublishFailed: batch (\d+):")


class SparkSequences:
    """The job and its feeder (module docstring); ``with`` starts both and ends every
    process of the job's session by PID."""

    def __init__(
        self,
        spec: StreamSpec,
        etcd_endpoints: str,
        amqp_url: str,
        directory: Path,
        *,
        keys: int = 12,
        rows_per_key: int = 10,
        every: float = 0.5,
        master: str = "local[2,4]",
    ) -> None:
        self.spec = spec
        self.keys = [f"spark-{i:03d}" for i in range(keys)]
        self.rows_per_key = rows_per_key
        self.every = every
        self.source = directory / "in"
        self.checkpoint = directory / "chk"
        self.log = directory / "job.log"
        self.args = [
            "--etcd-endpoints", etcd_endpoints,
            "--amqp-url", amqp_url,
            "spark-job", "--stream", spec.name, "--master", master,
            "--source", str(self.source), "--format", "json", "--schema", SCHEMA,
            "--key-column", "key", "--order-column", "seq",
            "--checkpoint", str(self.checkpoint),
            "--max-files-per-trigger", "1", "--trigger-seconds", "0",
            *SPARK_CONF_ARGS,
        ]  # fmt: skip
        self.files = 0
        self._halt = threading.Event()
        self._feeder = threading.Thread(target=self._feed, name="spark-feeder", daemon=True)
        self._stack = contextlib.ExitStack()
        self._process: subprocess.Popen[bytes] | None = None

    def _rows(self, file: int) -> list[dict[str, Any]]:
        first = file * self.rows_per_key
        return [
            {"key": key, "seq": seq}
            for seq in range(first, first + self.rows_per_key)
            for key in self.keys
        ]

    def _feed(self) -> None:
        # a new file every ``every`` seconds while at most one waits: the job publishes
        # all the time without falling behind (a batch takes 1-4 s on a busy machine)
        while not self._halt.wait(self.every):
            if self.files - self.committed() <= 1:
                self._write(self.files)

    def _write(self, file: int) -> None:
        # one file, named and timed after the ones before it (the source takes them in order)
        staging = self.source / f"f{file:05d}"
        write_json_rows(staging, self._rows(file), 1)
        (staging / "part-000.json").rename(self.source / f"part-{file:05d}.json")
        staging.rmdir()
        self.files = file + 1

    def start(self) -> Self:
        self.source.mkdir(parents=True, exist_ok=True)
        self._write(0)
        self._process = self._stack.enter_context(job_process(self.args, self.log))
        self._feeder.start()
        return self

    def _alive(self) -> bool:
        assert self._process is not None and self._process.poll() is None, (
            f"the Spark job exited: {self.tail()}"
        )
        return True

    def committed(self) -> int:
        return len(committed_batches(self.checkpoint))

    def wait_publishing(self, batches: int = 2, timeout: float = 240.0) -> None:
        """Until ``batches`` batches are committed (Spark's start-up is over)."""
        wait_until(
            lambda: self._alive() and self.committed() >= batches, timeout, 0.2,
            f"the Spark job committing {batches} batches",
        )  # fmt: skip

    def wait_in_flight(self, records: Path, timeout: float = 60.0) -> int:
        """Until the consumers handle a message of a batch not yet committed: its tasks are
        publishing now. Returns that batch's id."""

        def publishing() -> int | None:
            self._alive()
            batch = self.committed()
            with contextlib.suppress(FileNotFoundError), records.open("rb") as f:
                f.seek(max(0, f.seek(0, 2) - 65536))
                tail = f.read().decode(errors="replace")
                seen = f'"message_id": "{self._query_id()}:{batch}:' in tail
                if seen and batch == self.committed():
                    return batch + 1  # 0 is falsy
            return None

        return int(wait_until(publishing, timeout, 0.01, "a Spark batch being published")) - 1

    def _query_id(self) -> str:
        """The query's id (in every message id), from the checkpoint's metadata."""
        return str(json.loads((self.checkpoint / "metadata").read_text())["id"])

    def commit_times(self) -> list[float]:
        """Wall-clock time of each batch's commit, in batch order."""
        commits = self.checkpoint / "commits"
        return [(commits / str(b)).stat().st_mtime for b in committed_batches(self.checkpoint)]

    def after(self, at: float, until: float | None = None) -> tuple[float, float, int]:
        """From ``at`` (wall clock, a fault) to ``until`` (default: now): seconds to the first
        commit after ``at``, the longest pause between commits (from the last one before
        ``at``), and how many batches were committed in that window."""
        until = time.time() if until is None else until
        times = self.commit_times()
        before = [t for t in times if t <= at][-1:]
        inside = [t for t in times if at < t <= until]
        assert inside, f"no batch committed between the fault and {until}: {self.tail()}"
        span = [*before, *inside]
        pause = max((b - a for a, b in itertools.pairwise(span)), default=inside[0] - at)
        return inside[0] - at, pause, len(inside)

    def finish(self, timeout: float = 240.0) -> None:
        """Stop feeding; wait until every file written is published and committed."""
        self._halt.set()
        self._feeder.join(30)
        wait_until(
            lambda: self._alive() and self.committed() >= self.files, timeout, 0.2,
            f"the Spark job committing all {self.files} files",
        )  # fmt: skip
        assert committed_batches(self.checkpoint) == list(range(self.files))

    def confirmed(self) -> set[tuple[str, int]]:
        """(key, seq) of every row of a committed batch."""
        return {(row["key"], row["seq"]) for b in range(self.committed()) for row in self._rows(b)}

    def retried_batches(self) -> set[int]:
        """Batches a task of which failed (not every message confirmed) and was tried again."""
        return {int(b) for b in _RETRIED.findall(self.log.read_text(errors="replace"))}

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        self._halt.set()
        if self._feeder.is_alive():
            self._feeder.join(30)
        self._stack.close()  # every process of the job's session, by PID
        self._process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replayed_batch(record: dict[str, Any], batches: set[int]) -> bool:
    """True for a record of a Spark message of one of ``batches``."""
    try:
        return ReplayId.parse(str(record["message_id"])).batch_id in batches
    except ValueError:  # the SDK's ids are "key:seq"
        return False


def order_apart_from_replays(
    records: list[dict[str, Any]], retried: set[int], crashes: Sequence[audit.Crash] = ()
) -> tuple[list[str], int]:
    """Per-key order violations (what ``crashes`` excuse apart: ``audit.order_violations``)
    outside the batches a task of which was tried again, and how many more there are inside
    them. A retried task publishes its messages again, after newer ones of their key when
    the first attempt had some nacked: those are counted, every other violation is a
    failure."""
    rest = [r for r in records if not replayed_batch(r, retried)]
    outside = audit.order_violations(rest, crashes)
    every = audit.order_violations(records, crashes)
    return outside, max(0, len(every) - len(outside))


def handled_twice(records: Iterable[dict[str, Any]], prefix: str) -> int:
    """Messages of keys starting with ``prefix`` handled more than once."""
    counts = Counter(r["message_id"] for r in records if str(r["key"]).startswith(prefix))
    return sum(1 for n in counts.values() if n > 1)
