"""Planned handoff by consumer priority: the broker switches owners, no quiet timer. Pure.

RabbitMQ 4.0's quorum queues ("SAC consumer priority", rabbitmq-server 203b671) activate a
waiting consumer whose ``x-priority`` is above the active one's, but only once the active
one has settled every delivery it holds, and send the active one nothing more meanwhile.
No 3.x release does it, nor a classic queue on any version (docs/benchmarks.md, "Single
active consumer and consumer priority").

So where it holds, a planned handoff needs no drain: the heir subscribes with a priority
above the owner's while the owner is still consuming; the owner handles and acks on as
usual (no held acks, no ``basic.cancel`` while it may have credit); the heir's first
delivery proves the switch (the owner settled everything and is sent nothing more); the
owner's consumer, now waiting, is cancelled then (``Broker.cut``: nothing is checked out
to it, so nothing is returned). Priorities only ever grow per partition (a counter bumped
at each assignment): every heir outranks every consumer subscribed before it.

In the daemon (``partq.consumers.control.partitions``) the priority lives in the partition's claim
(the
x-priority its holder consumes with; 0 for a fresh claim), so the heir's is the claim's
plus one, written into its own claim by the takeover. An owner whose partition moves to a
live member that hands over by priority too (its member key says so) *yields*: it consumes
on and waits for the claim to change. The heir subscribes above it as a hot standby does
(``partq.consumers.state.standby``: deliveries are kept unhandled until decided) and, once the
broker
switches to it, takes the claim over by a transaction on the revision it subscribed
behind (:func:`inherits_claim`); then its deliveries go to a new worker. Every cancel of a
consumer that an heir may be waiting above is preceded by *sealing* the claim (a
rewrite, ``Group.seal``): a cancel activates the heir while the owner still handles its
window, and the sealed claim is no longer the one the heir subscribed behind, so its
takeover fails and it gives everything back, in order; nobody subscribes as heir behind a
sealed claim. So the claim still changes hands only once the switch is proven, and the
heir handles nothing before it holds the claim.

Threads. None: pure functions, called on the daemon's controller thread and the thread
that calls ``Broker.subscribe``.
"""

from __future__ import annotations

from partq.coordinator.store.group import Claim

__all__ = [
    "IDLE_BEFORE_DRAIN",
    "MAX_PRIORITY",
    "PRIORITY_ARGUMENT",
    "YIELD_WAIT",
    "Arguments",
    "consume_arguments",
    "heir_priority",
    "inherits_claim",
    "rank",
    "switches",
]

PRIORITY_ARGUMENT = "x-priority"  # basic.consume argument, a signed 32-bit integer
MAX_PRIORITY = 2**31 - 1
# Seconds an owner consumes on, yielding, before it drains after all: an idle queue switches
# to the heir at once but silently (no delivery proves it to the heir), and a slow handler
# may take longer than this to settle its window (then the drain, as without priorities).
# Below the announced leave's wait (5 s), so a stop's idle partitions move by then.
YIELD_WAIT = 2.0
# ... and only once the owner's worker has waited this long for a delivery (it handled all
# it was sent): a busy owner's cancel would activate the heir beside it.
IDLE_BEFORE_DRAIN = 1.0


Arguments = dict[str, int] | None  # basic.consume's arguments (None: none)


def consume_arguments(priority: int | None) -> Arguments:
    """``basic.consume`` arguments for a consumer of ``priority`` (None: no argument,
    RabbitMQ's default 0)."""
    if priority is None:
        return None
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"consumer priority {priority} is outside 0..{MAX_PRIORITY}: reset the "
            "partition's priority counter"
        )
    return {PRIORITY_ARGUMENT: priority}


def rank(arguments: Arguments) -> int:
    """The priority a consumer subscribed with ``arguments`` has (RabbitMQ's default: 0)."""
    return (arguments or {}).get(PRIORITY_ARGUMENT, 0)


def heir_priority(owner: int | None) -> int:
    """The priority the heir subscribes with: one above the owner's (None: no priority)."""
    return 1 if owner is None else owner + 1


def switches(version: str, queue_type: str) -> bool:
    """Does a single-active-consumer queue of ``queue_type`` on a broker reporting
    ``version`` (AMQP ``server_properties["version"]``, e.g. ``"4.0.5"``) switch to a
    higher-priority waiting consumer once the active one has settled everything?"""
    if queue_type != "quorum":
        return False
    major = version.split(".", 1)[0]
    return major.isdigit() and int(major) >= 4


def inherits_claim(claim: Claim, revision: int | None, behind: str, seen: int) -> bool:
    """Whether ``claim`` (at mod ``revision``) is still the one an heir subscribed behind:
    ``behind``'s, at revision ``seen``, so never sealed (its holder cancelled nothing).

    Then, once the broker has switched to the heir, it may take the claim over: its holder
    settled everything (or its connection died, and what it held came back first), and
    whether the partition is still assigned to the heir does not matter (giving back what
    an active consumer was sent is not in order; once ours, the partition moves on as any
    of ours would). The takeover is a transaction on revision ``seen``: the same check,
    made by etcd."""
    return claim.member == behind and not claim.sealed and revision == seen
