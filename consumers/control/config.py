"""What a consumer is configured with, and the exit codes it ends with
(``partq.consumers.control.daemon``).

A consumer never dies silently. :meth:`partq.consumers.control.daemon.Consumer.run` returns an exit
code
(``partq consume`` exits with it):

- 0 (:data:`EXIT_OK`): stopped on request, every partition drained.
- 1 (:data:`EXIT_DRAIN_TIMEOUT`): stopped, but the drain deadline passed.
- 3 (:data:`EXIT_HANDLER_TIMEOUT`): a handler ran past ``handler_timeout``. Its
  message was dead-lettered (``HandlerTimeout``); the member left the group.
- 4 (:data:`EXIT_WORKER_FAILED`): a partition worker failed (traceback logged,
  ``partq_consumer_worker_failures_total{reason="crash"}``); the member left the group.
- 5 (:data:`EXIT_STREAM_CHANGED`): the stream was deleted and recreated with another
  partition count; partitions are fixed, so this member cannot go on.
- 6 (:data:`EXIT_PERMISSION_DENIED`): RabbitMQ refused the user a partition's queue
  (403 ACCESS_REFUSED on basic.consume): the error line names the queue, the user and
  the permission to grant. Retrying cannot help, and a member that holds a partition
  it cannot read stalls it: it leaves the group so the partition moves to another member.

On 3, 4 and 6, ``/readyz`` turns false at once; the other partitions are drained
and released as on a stop, the failed one is abandoned (its unacked deliveries
return to the queue when the connection closes, before the lease is revoked):
the partition moves to another member and the supervisor restarts this one.

Threads. None: a :class:`ConsumerConfig` is frozen before the daemon starts a thread, and
every thread only reads it.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, fields
from typing import Any

from partq.coordinator.store.codec import MAX_WEIGHT
from partq.coordinator.store.group import validate_member_id

from partq.kernel import __version__
from partq.kernel.amqp import MAX_PREFETCH
from partq.kernel.errors import UsageError
from partq.kernel.settings import (
    DEFAULT_AMQP_OUTAGE_LIMIT,
    DEFAULT_CONCURRENCY,
    DEFAULT_HANDOFF,
    DEFAULT_STALL_AFTER,
    MAX_CONCURRENCY,
    Settings,
)

__all__ = [
    "DEFAULT_HANDLER_TIMEOUT",
    "EXIT_DRAIN_TIMEOUT",
    "EXIT_HANDLER_TIMEOUT",
    "EXIT_OK",
    "EXIT_PERMISSION_DENIED",
    "EXIT_STREAM_CHANGED",
    "EXIT_WORKER_FAILED",
    "ConsumerConfig",
    "default_member_id",
]

EXIT_OK = 0
EXIT_DRAIN_TIMEOUT = 1
EXIT_HANDLER_TIMEOUT = 3
EXIT_WORKER_FAILED = 4
EXIT_STREAM_CHANGED = 5
EXIT_PERMISSION_DENIED = 6
# A handler may run this long per message by default: far longer than any per-message
# work should take, and well below RabbitMQ's consumer_timeout (30 min by default), past
# which the broker itself would close the channel and return the partition's messages.
DEFAULT_HANDLER_TIMEOUT = 300.0


@dataclass(frozen=True)
class ConsumerConfig:
    stream: str
    member_id: str | None = None
    weight: int = 1
    prefetch: int = 100
    ttl: int = 5
    heartbeat: int | None = None  # AMQP heartbeat; default: the lease TTL
    max_attempts: int = 5
    retry_backoff: float = 0.1
    drain_timeout: float = 20.0
    partitions: int | None = None  # expected partition count; refused if etcd differs
    version: str = __version__  # of the installed partq (kernel.__version__)
    # Seconds a handler may run per message (None or 0: no limit). Past it the message is
    # dead-lettered and the member exits with EXIT_HANDLER_TIMEOUT (see the module docstring).
    handler_timeout: float | None = DEFAULT_HANDLER_TIMEOUT
    # On a stop, first mark the member "leaving" so the leader moves its partitions to
    # others while it still consumes them (planned handoffs), then leave; after
    # ``announce_wait`` seconds whatever is still ours is drained and released as without it.
    announce_leave: bool = True
    announce_wait: float = 5.0
    # Seconds between load reports (what this member handled per partition, put in etcd for
    # the leader's lag-aware assignment and the status page); 0: no reports.
    load_report: float = 5.0
    # Seconds without a usable RabbitMQ connection before the member leaves its group (the
    # setting PARTQ_AMQP_OUTAGE_LIMIT; partq.kernel.settings.DEFAULT_AMQP_OUTAGE_LIMIT).
    amqp_outage_limit: float = DEFAULT_AMQP_OUTAGE_LIMIT
    # Messages of different keys of a partition handled at once, at most this many in the
    # member (the setting PARTQ_CONCURRENCY); 1: one at a time per partition, as always.
    concurrency: int = DEFAULT_CONCURRENCY
    # Seconds an owned partition's worker may wait for a delivery while its queue has
    # messages ready before that is logged and counted as a stall (partq.consumers.state.flow); 0:
    # never.
    stall_after: float = DEFAULT_STALL_AFTER
    # How a planned handoff moves a partition (the setting PARTQ_HANDOFF): "auto", by
    # consumer priority where the broker switches (partq.consumers.state.priority), else the drain;
    # "drain": always the drain.
    handoff: str = DEFAULT_HANDOFF

    @classmethod
    def of(cls, stream: str, settings: Settings, **options: Any) -> ConsumerConfig:
        """``stream``'s config: the consumer settings that ``settings`` holds
        (PARTQ_AMQP_OUTAGE_LIMIT, PARTQ_CONCURRENCY, PARTQ_STALL_AFTER, PARTQ_HANDOFF),
        ``options`` over
        them (a flag given, a keyword of ``consumers.run``); an option not in
        :meth:`options` is a :class:`UsageError` naming those."""
        unknown = sorted(set(options) - set(cls.options()))
        if unknown:
            raise UsageError(
                f"unknown consumer option {', '.join(map(repr, unknown))}: give only "
                f"{', '.join(cls.options())}"
            )
        from_settings = {
            "amqp_outage_limit": settings.amqp_outage_limit,
            "concurrency": settings.concurrency,
            "stall_after": settings.stall_after,
            "handoff": settings.handoff,
        }
        return cls(stream=stream, **{**from_settings, **options})

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The options :meth:`of` takes: every field but ``stream`` and ``version``."""
        return tuple(f.name for f in fields(cls) if f.name not in ("stream", "version"))

    def __post_init__(self) -> None:
        if self.member_id is not None:  # InvalidMemberId: a usage error, exit code 2
            validate_member_id(self.member_id)
        else:  # chosen once: every part of the daemon must name the same member
            object.__setattr__(self, "member_id", default_member_id())
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise UsageError(f"weight must be 1 to {MAX_WEIGHT}, got {self.weight}")
        if not 1 <= self.prefetch <= MAX_PREFETCH:  # a usage error: exit 2, one line
            raise UsageError(
                f"prefetch must be between 1 and {MAX_PREFETCH} (RabbitMQ's basic.qos takes a "
                f"16-bit count), got {self.prefetch}"
            )
        if not self.amqp_outage_limit > 0:
            raise UsageError(f"AMQP outage limit must be above 0, got {self.amqp_outage_limit}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:  # one handler thread each
            raise UsageError(
                f"concurrency must be between 1 and {MAX_CONCURRENCY} (one handler thread "
                f"each; run more members for more), got {self.concurrency}"
            )
        if self.max_attempts < 1:
            raise UsageError(f"max attempts must be at least 1, got {self.max_attempts}")
        if not self.load_report >= 0:
            raise UsageError(f"load report interval must be 0 or more, got {self.load_report}")
        if not self.stall_after >= 0:
            raise UsageError(f"stall bound must be 0 or more, got {self.stall_after}")
        if self.handoff not in ("auto", "drain"):
            raise UsageError(f"handoff must be auto or drain, got {self.handoff!r}")
        if self.handler_timeout is not None and not self.handler_timeout >= 0:
            raise UsageError(f"handler timeout must be 0 or more, got {self.handler_timeout}")

    @property
    def member(self) -> str:
        assert self.member_id is not None  # set in __post_init__
        return self.member_id


def default_member_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
