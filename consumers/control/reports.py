"""What a consumer tells about its partitions: load reports (etcd) and stalls (logs, metrics).

Threads. :class:`Reports` belongs to the daemon's controller thread, which calls it on its
timer events (``ReportLoad``, ``CheckFlow``) and on the broker's ``ReadyCounts``. It reads
the workers through :class:`partq.consumers.control.partitions.Partitions` (one value each:
``handled``,
``waiting_since``), and asks the broker for ready counts, which come back as an event.
"""

from __future__ import annotations

import logging
import time

from partq.consumers import metrics
from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.config import ConsumerConfig
from partq.consumers.control.partitions import Partitions
from partq.consumers.handling.keyed import concurrency_report
from partq.consumers.handling.parking import Parking
from partq.consumers.state.flow import FlowWatch
from partq.consumers.state.load import LoadMeter
from partq.coordinator.store.codec import LoadReport
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session

from partq.kernel.errors import PartqError

__all__ = ["Reports"]

log = logging.getLogger("partq.consumer")


class Reports:
    """One member's load reports and stall checks (the module docstring)."""

    def __init__(
        self,
        config: ConsumerConfig,
        labels: tuple[str, str],
        group: Group,
        partitions: Partitions,
        broker: BrokerPort,
        parking: Parking | None,
    ) -> None:
        self.config = config
        self.member = config.member
        self.labels = labels
        self.group = group
        self.partitions = partitions
        self.broker = broker
        self.parking = parking
        self.load = LoadMeter()
        self.flow = FlowWatch()

    def report_load(self, session: Session | None) -> None:
        """Put what we handled per partition since the last report; none without a
        session, or while etcd does not answer (this thread must not wait on a report)."""
        workers = dict(self.partitions.workers)
        rates, elapsed = self.load.rates({p: (w, w.handled) for p, w in workers.items()})
        if session is None or session.lost.is_set():
            return
        if not session.fresh():  # etcd has not answered lately: no report to wait on
            return
        stalled = tuple(self.parking.stalls.stalled()) if self.parking is not None else ()
        report = LoadReport(
            self.member,
            rates,
            time.time(),
            round(elapsed, 3),
            stalled,
            self.partitions.in_flight(),
            concurrency_report(self.config.concurrency, workers),
        )
        try:
            self.group.report_load(report, session)
        except PartqError as e:  # etcd away, or the role may not write it: consuming goes on
            log.warning("cannot report load: %s", e)

    def _waiting(self) -> set[int]:
        """Owned partitions whose worker has waited for a delivery past the stall bound."""
        bound = time.monotonic() - self.config.stall_after
        workers = self.partitions.workers
        return {
            p
            for p in self.partitions.owned()
            if (w := workers.get(p)) is not None
            and (since := w.waiting_since) is not None
            and since < bound
        }

    def check_flow(self) -> None:
        """Ask RabbitMQ what is ready for the partitions whose workers wait
        (``partq.consumers.state.flow``):
        the answer comes back as ``ReadyCounts`` (to :meth:`flow`)."""
        waiting = sorted(self._waiting())
        if waiting:
            self.broker.ready(waiting)
        else:
            self.flow_ready({})

    def flow_ready(self, ready: dict[int, int]) -> None:
        change = self.flow.check(set(self.partitions.owned()), self._waiting(), ready)
        for partition, count in change.began.items():
            log.warning(
                "partition %d: stalled: %d messages ready in its queue, and RabbitMQ delivered "
                "nothing for over %gs though the worker waits (partq_consumer_stalled_partitions)",
                partition,
                count,
                self.config.stall_after,
            )
            metrics.STALLS.labels(*self.labels).inc()
        for partition in change.ended:
            log.info("partition %d: no longer stalled", partition)
        metrics.STALLED.labels(*self.labels).set(len(change.stalled))
