"""The ack window machine's terms (:mod:`partq.consumers.state.window`): the window's
record (:class:`Window`, its :class:`Phase`), the events the shell feeds the machine, and
the actions it answers with. Pure values: the transitions are ``window``'s.

Threads. None: immutable values, made and read on the pika I/O thread (the shell,
``partq.consumers.broker.channels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Phase(Enum):
    PARKED = "parked"  # open, no consumer: warm, or drained (reused by the next subscribe)
    CONSUMING = "consuming"
    HOLDING = "holding"  # draining: acks held until the window is full or the queue quiet
    EMPTIED = "emptied"  # full and every delivery handled (``early``): waiting for ``Cut``
    CANCELLING = "cancelling"  # basic.cancel sent; a round trip, then END to the worker
    ENDING = "ending"  # END sent: waiting for the worker's ``Finish``
    CUTTING = "cutting"  # basic.cancel sent by ``Cut``: the held acks follow its CancelOk


_CONSUMING = frozenset(
    {Phase.CONSUMING, Phase.HOLDING, Phase.EMPTIED, Phase.CANCELLING, Phase.CUTTING}
)
HOLDING = frozenset({Phase.HOLDING, Phase.EMPTIED, Phase.CANCELLING, Phase.ENDING, Phase.CUTTING})


class Window(NamedTuple):
    """One subscription's counts and phase. ``early``: report EMPTIED (see the module).
    A named tuple, not a dataclass: one is made per delivery, and a tuple is the cheapest
    immutable value to make."""

    prefetch: int
    early: bool = False
    phase: Phase = Phase.CONSUMING
    received: int = 0
    acks_sent: int = 0
    held: tuple[int, ...] = ()  # delivery tags acked by the worker while holding, in order
    held_since: float = 0.0
    drains: int = 0  # drains begun: a called-off one's timers see a newer count and stop
    fill: bool = False  # the queue takes fillers (bound to the dead-letter exchange)
    filled_at: float | None = None  # when this drain published its fillers

    @property
    def consuming(self) -> bool:
        """``basic.consume`` sent and its cancel's round trips not done."""
        return self.phase in _CONSUMING

    @property
    def holding(self) -> bool:
        return self.phase in HOLDING

    @property
    def live(self) -> bool:
        """Its channel's loss is the partition's (anything but PARKED)."""
        return self.phase is not Phase.PARKED

    @property
    def credit(self) -> int:
        """What the broker may still send this consumer: the prefetch less its unacked."""
        return self.prefetch - (self.received - self.acks_sent)

    @property
    def full(self) -> bool:
        """True when the broker provably has no credit left for this consumer."""
        return self.credit <= 0


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivered:
    """One delivery arrived on the channel."""


@dataclass(frozen=True, slots=True)
class Acked:
    """The worker acked ``tags`` (in that order)."""

    tags: tuple[int, ...]


class Pace(NamedTuple):
    """The channel's deliveries as the shell saw them: when the last arrived (monotonic
    seconds) and the mean gap between recent ones (seconds). The default: none seen."""

    last: float = float("-inf")
    gap: float = float("inf")

    def idle(self, now: float) -> float:
        return now - self.last


_UNKNOWN = Pace()


@dataclass(frozen=True, slots=True)
class Revoke:
    """Begin a drain (``Broker.cancel``) at ``now``. ``waiting``: RabbitMQ serves another
    consumer of the queue, not this one (another member holds the claim, given only once
    the broker had activated it): nothing can be in flight to us, so cancel at once,
    without fillers (they would go to that consumer, and ours would linger, waiting).
    Only while nothing it was sent is unsettled: a consumer with deliveries in hand was
    the active one, and may still be (the holder's consumer can be gone too, its
    connection cut by the same node's death). Cancelled then, the broker serves the
    holder newer messages while ours still handles its own (seen in a soak: two owners at
    once for 90 ms). Such a drain goes the usual way (held, full, emptied, cut)."""

    now: float
    waiting: bool = False
    pace: Pace = _UNKNOWN


@dataclass(frozen=True, slots=True)
class Quiet:
    """:data:`QUIET` seconds after drain ``drain`` saw ``seen`` deliveries; ``late``: seconds
    the timer fired after it was due (the process was stalled)."""

    drain: int
    seen: int
    now: float
    pace: Pace = _UNKNOWN
    late: float = 0.0


@dataclass(frozen=True, slots=True)
class Ready:
    """The passive declare asked by :class:`AskReady`: ``ready`` messages in the queue."""

    drain: int
    seen: int
    ready: int
    now: float
    pace: Pace = _UNKNOWN


@dataclass(frozen=True, slots=True)
class Unfilled:
    """The fillers of drain ``drain`` cannot reach the queue (returned unroutable, or the
    stream has no dead-letter exchange)."""

    drain: int


@dataclass(frozen=True, slots=True)
class Resume:
    """Call the drain off (``Broker.resume``)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """After EMPTIED: cancel, then send the held acks (``Broker.cut``)."""


@dataclass(frozen=True, slots=True)
class CancelOk:
    """The broker confirmed ``basic.cancel`` (or there was no consumer tag to cancel)."""


@dataclass(frozen=True, slots=True)
class BarrierOk:
    """The round trip after CancelOk is back: every delivery sent before it has arrived."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The worker handled everything up to END (``Broker.finish``)."""


WindowEvent = (
    Delivered
    | Acked
    | Revoke
    | Quiet
    | Ready
    | Unfilled
    | Resume
    | Cut
    | CancelOk
    | BarrierOk
    | Finish
)


# -- actions, carried out in order by the shell -------------------------------------------


@dataclass(frozen=True, slots=True)
class HandOn:
    """Give the delivery that arrived to the worker."""


@dataclass(frozen=True, slots=True)
class Reject:
    """Requeue the delivery that arrived: no credit was left, it cannot be ours to handle."""


@dataclass(frozen=True, slots=True)
class Ack:
    """Send these acks now (one multiple ack where they are the oldest unacked)."""

    tags: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AckEach:
    """Send the held acks, one ``basic.ack`` each, in order."""

    tags: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Send ``basic.cancel``; ``overdue``: held that long while deliveries still arrived."""

    overdue: float | None = None


@dataclass(frozen=True, slots=True)
class Fill:
    """Publish ``count`` fillers into the queue for drain ``drain``
    (``partq.consumers.broker.fillers``)."""

    drain: int
    count: int


@dataclass(frozen=True, slots=True)
class Barrier:
    """A round trip (``basic.qos``), then :class:`BarrierOk`."""


@dataclass(frozen=True, slots=True)
class SendEnd:
    """END to the worker, after every delivery it was given."""


@dataclass(frozen=True, slots=True)
class WaitQuiet:
    """Feed :class:`Quiet` after :data:`QUIET` seconds."""

    drain: int
    seen: int


@dataclass(frozen=True, slots=True)
class AskReady:
    """Count the messages ready in the queue (passive declare), then feed :class:`Ready`."""

    drain: int
    seen: int


@dataclass(frozen=True, slots=True)
class ReportEmptied:
    """Report the partition emptied."""


@dataclass(frozen=True, slots=True)
class ReportKept:
    """Report the drain called off."""


@dataclass(frozen=True, slots=True)
class ReportDrained:
    """After a round trip (the acks went first), report the partition drained."""


@dataclass(frozen=True, slots=True)
class ReportLost:
    """Report the partition's channel lost: nothing to drain on it."""


Action = (
    HandOn
    | Reject
    | Ack
    | AckEach
    | Cancel
    | Fill
    | Barrier
    | SendEnd
    | WaitQuiet
    | AskReady
    | ReportEmptied
    | ReportKept
    | ReportDrained
    | ReportLost
)
Actions = tuple[Action, ...]
# the actions that only tell the daemon: carried out whatever the channel's state
REPORTS = (SendEnd, ReportEmptied, ReportKept, ReportLost)
