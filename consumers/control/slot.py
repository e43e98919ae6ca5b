"""One partition on a consumer, as the member's controller keeps it: one slot per partition.

A :class:`PartitionSlot` holds everything the member knows of one partition: its handoff
state (``partq.consumers.state.handoff``: phase, assignment, claim holder, pause, standby phase),
the
worker consuming it, the stopped worker the next one must wait for, when the claim was
freed (for the handoff gap), whether the partition was abandoned, which owner our standby
subscription waits behind, and which dead owner we took it over from. The claims
themselves are the group mirror's (``partq.coordinator.store.mirror``); the state only says whose.

Threads. Slots belong to the daemon's controller thread (``partq.consumers.control.partitions``): it
alone writes them, and only through their methods: ``state`` and what an event tells
beside it (``freed_at``, ``yielded_at``, ``behind`` forgotten) through
:meth:`PartitionSlot.step`, the rest through one method each. A slot
is made once per partition and never replaced, so two other threads read it without a
lock, one attribute at a time: the pika I/O thread reads ``worker`` to put a delivery in
its inbox, and the HTTP server thread's scrape reads ``worker`` (its ``busy`` and
``longest_wait``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from partq.consumers.handling.worker import Worker
from partq.consumers.state.handoff import Command, Event, Phase, Standby, State, step

__all__ = ["NOBODY", "Behind", "PartitionSlot", "WorkerView"]


@dataclass(frozen=True, slots=True)
class Behind:
    """Whom our standby subscription of a partition waits behind: the claim's ``owner``;
    as its heir (``partq.consumers.state.priority``) also the claim's ``lease`` and
    revision (``seen``) when we subscribed, and our x-priority (``rank``). ``seen`` 0: a
    hot standby's subscription; ``owner`` "": no standby."""

    owner: str = ""
    lease: int = 0
    seen: int = 0
    rank: int = 0

    @property
    def heir(self) -> bool:
        return self.seen != 0


NOBODY = Behind()


@dataclass(eq=False, slots=True)
class PartitionSlot:
    """One partition of the stream, from this member's side (the module docstring). Every
    field is written by the slot's own methods only; read them anywhere."""

    partition: int
    state: State = field(default_factory=State)
    worker: Worker | None = None  # consumes the partition now
    # stopped but maybe still in its handler: the partition's next worker waits for it (one
    # handler per partition in this process, also after a fence)
    retired: Worker | None = None
    freed_at: float | None = None  # when the claim was freed or handed to us (epoch seconds)
    abandoned: bool = False  # its worker failed: nothing is handled or drained here any more
    behind: Behind = NOBODY  # whom our standby subscription waits behind, while standing by
    yielded_at: float = 0.0  # when it last began YIELDING (monotonic), for its deadline
    taken_from: str | None = None  # taken over from this (dead) owner, until reassigned

    def step(self, event: Event) -> tuple[State, list[Command]]:
        """Feed ``event`` to the state machine; the state before, and the commands. What
        the event tells beside the state is kept too: when the claim was freed or handed
        to us, when a yield began; a standby ended forgets whom it stood behind."""
        before = self.state
        self.state, commands = step(before, event)
        if event in (Event.CLAIM_FREE, Event.GRANTED):
            self.freed_at = time.time()
        if self.state.phase is Phase.YIELDING and before.phase is not Phase.YIELDING:
            self.yielded_at = time.monotonic()
        if self.state.standby is Standby.NONE:
            self.behind = NOBODY
        return before, commands

    def stands_behind(self, behind: Behind) -> None:
        """Our standby subscription was made (``STAND_BY``): behind whom."""
        self.behind = behind

    def taken_over(self, owner: str | None) -> None:
        """We are taking the partition over from ``owner``, a dead member (None: as its
        heir, from a live one): it counts as ours while the assignment still names it."""
        if owner is not None:
            self.taken_from = owner

    def abandon(self) -> None:
        """Its worker failed: nothing is handled or drained here any more."""
        self.abandoned = True

    def drop(self) -> None:
        """A fence: the worker stops (kept for the next to wait for), the state starts over."""
        self.retire()
        self.step(Event.DROPPED)

    def hire(self, make: Callable[[Worker | None, float | None], Worker]) -> Worker:
        """The partition's next worker: ``make(previous, freed_at)`` given the worker it
        must wait for (:meth:`predecessor`) and when the claim was freed, once."""
        worker = make(self.predecessor(), self.take_freed_at())
        self.worker = worker
        return worker

    def ours(self, owner: str | None, member: str, *, leaving: bool) -> bool:
        """Whether the partition counts as assigned to ``member``: the assignment names it,
        or we took the partition over and the assignment still names the owner we took it
        from (``taken_from`` is forgotten once the assignment names anyone else)."""
        if self.taken_from is not None and owner != self.taken_from:
            self.taken_from = None
        return (owner == member or self.taken_from is not None) and not leaving

    def predecessor(self) -> Worker | None:
        """Stop and hand over the worker a new one must wait for: the current one, or else
        the retired one."""
        old = self.worker
        if old is None:
            old, self.retired = self.retired, None
        if old is not None:
            old.stop()
        return old

    def retire(self) -> None:
        """Stop the worker and keep it as the one the partition's next worker waits for."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.stop()
            self.retired = worker

    def take_freed_at(self) -> float | None:
        """When the claim was freed, once: the next worker measures its handoff gap from it."""
        freed_at, self.freed_at = self.freed_at, None
        return freed_at


class WorkerView(Mapping[int, Worker]):
    """The workers consuming now, by partition: a read-only view of the slots. ``get`` is
    what the I/O thread calls for each delivery: one dict lookup, one attribute read."""

    def __init__(self, slots: Mapping[int, PartitionSlot]) -> None:
        self._slots = slots

    # one signature instead of Mapping.get's overloads: a worker or the default (None)
    def get(self, partition: int, default: Worker | None = None) -> Worker | None:  # type: ignore[override]
        slot = self._slots.get(partition)
        worker = None if slot is None else slot.worker
        return default if worker is None else worker

    def __getitem__(self, partition: int) -> Worker:
        worker = self.get(partition)
        if worker is None:
            raise KeyError(partition)
        return worker

    def __iter__(self) -> Iterator[int]:
        return (p for p, slot in self._slots.items() if slot.worker is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
