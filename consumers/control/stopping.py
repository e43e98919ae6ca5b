"""How a consumer stops: announced, then it leaves its group and drains; and a failure,
which stops it the same way with an exit code (``partq.consumers.control.config``).

A stop (:meth:`partq.consumers.control.daemon.Consumer.stop`, or a signal) sets the drain
deadline and turns ``/readyz`` false. If the member could announce it (its member key
says it is leaving: the leader moves its partitions first), it leaves
``announce_wait`` seconds later (``LeaveNow``), else at once: it leaves the group and
drains what is still its own (abandoned partitions aside: their worker failed). A
worker's failure or a handler timeout abandons its partition, then stops the member with
exit code 4 (3 after a handler timeout).

:class:`Stopping` is a base class of :class:`partq.consumers.control.daemon.Consumer`.
Threads: its methods run on the daemon's controller thread, which alone reads and writes
``stopping``, ``exit_code`` and ``_deadline`` (its loop reads the deadline).
"""

from __future__ import annotations

import logging
import time

from partq.consumers.control.config import (
    EXIT_HANDLER_TIMEOUT,
    EXIT_WORKER_FAILED,
)
from partq.consumers.control.consumerstate import ConsumerState
from partq.consumers.control.events import LeaveNow
from partq.consumers.handling.worker import HANDLER_TIMEOUT

__all__ = ["Stopping"]

log = logging.getLogger("partq.consumer")


class Stopping(ConsumerState):
    """A consumer's stop and failures (the module docstring)."""

    def _worker_failed(self, partition: int, reason: str) -> None:
        """A worker stopped for good (it logged why): abandon its partition, leave, exit."""
        self.partitions.abandon(partition)
        if reason == HANDLER_TIMEOUT:
            self._fail(EXIT_HANDLER_TIMEOUT, f"partition {partition}: a handler timed out")
        else:
            self._fail(EXIT_WORKER_FAILED, f"partition {partition}: its worker failed")

    def _fail(self, code: int, why: str) -> None:
        """Not ready from now on; leave the group as on a stop; :meth:`run` returns ``code``."""
        if self.exit_code is None:
            self.exit_code = code
        log.error("%s: leaving the group, then exiting with code %d", why, self.exit_code)
        self.ready.clear()
        self._begin_stop()

    def _begin_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._deadline = time.monotonic() + self.config.drain_timeout
        self.ready.clear()
        if self.membership.announce():
            self._after(self.config.announce_wait, LeaveNow())
            return
        self._leave_now()

    def _leave_now(self) -> None:
        abandoned = self.partitions.abandoned
        draining = [p for p in self.owned() if p not in abandoned]
        log.info(
            "stopping: leaving the group and draining %d partitions%s",
            len(draining),
            f" (abandoning {sorted(abandoned)})" if abandoned else "",
        )
        self.partitions.leaving = True
        self.membership.leave()
        if not self._broker_up:
            # Nothing can be drained: the broker requeued what we held when the connection
            # died, and no subscription was made since (the controller makes them). Waiting
            # would only run out the drain timeout; the claims go with the revoked lease.
            self.partitions.drop()
        self.partitions.sync_all()
