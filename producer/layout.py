"""Layouts of a stream's partitions and the resize from one to the next (pure: no I/O).

A :class:`Layout` is an epoch and a partition count. Epoch 0 is the layout a stream is
created with, and under it everything is the wire contract of ``docs/contract.md``
unchanged: a key's partition is ``murmur3_x86_32(key) mod P`` and the routing key is the
partition in decimal. Each resize makes the next epoch; its routing keys carry the epoch
(``"E.q"``), so the broker binds each epoch apart and a publish made under an older layout
finds no binding once that layout is cut (``docs/resize.md``).

The partition of a key stays ``murmur3 mod N`` in every epoch, so a producer in any
language needs only N and the epoch. What modulo implies for a resize ``P -> N``
(:class:`Resize`), with ``g = gcd(P, N)`` and ``L = lcm(P, N)``:

- a key's old and new partitions are ``h mod P`` and ``h mod N``: both are fixed by
  ``h mod L``, and since ``L <= 2**32`` (both counts are at most 65,536) every residue of
  ``L`` is some hash. So new partition ``q`` is fed by exactly the old partitions
  ``p ≡ q (mod g)``: ``P / g`` parents. Doubling (``g = P``): one parent, ``q mod P``.
- a key stays in its queue when ``h mod P == h mod N``, which holds for exactly ``min(P, N)``
  residues of ``L``: a fraction ``min(P, N) / L`` stays. Doubling keeps half in place and
  sends the other half from ``p`` to ``p + P``; 24 -> 16 moves 2/3; 12 -> 17 moves 16/17.
- the gate: a message of key ``k`` under the new layout may be handled only after every
  message of ``k`` under the old one was. A key that stays needs no gate (its old and new
  messages share one queue, in order behind the fence); a key that moved waits for the
  fence of its one old partition (:meth:`Resize.gate`).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from fractions import Fraction

from partq.producer.contract import MAX_PARTITIONS, check_partition_count, partition_for

from partq.kernel.errors import UsageError

__all__ = ["Layout", "Resize", "parse_routing_key"]


@dataclass(frozen=True, slots=True)
class Layout:
    """``partitions`` partitions under epoch ``epoch`` (0: as the stream was created)."""

    partitions: int
    epoch: int = 0

    def __post_init__(self) -> None:
        check_partition_count(self.partitions)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise UsageError(f"a layout's epoch is a whole number >= 0, got {self.epoch!r}")

    def partition_for(self, key: str | bytes) -> int:
        return partition_for(key, self.partitions)

    def routing_key(self, partition: int) -> str:
        """The routing key of ``partition``: ``"q"`` in epoch 0 (the contract), else ``"E.q"``."""
        self.check(partition)
        return str(partition) if self.epoch == 0 else f"{self.epoch}.{partition}"

    def check(self, partition: int) -> int:
        if not 0 <= partition < self.partitions:
            raise ValueError(
                f"partition {partition} is outside 0..{self.partitions - 1} of epoch {self.epoch}"
            )
        return partition

    def resize(self, partitions: int, maximum: int = MAX_PARTITIONS) -> Resize:
        """The resize from this layout to ``partitions``; :class:`UsageError` (one line that
        says what to do) for a count out of ``1..maximum`` or equal to the current one."""
        if isinstance(partitions, bool) or not isinstance(partitions, int):
            raise UsageError(f"--partitions must be a whole number, got {partitions!r}")
        if not 1 <= partitions <= maximum:
            raise UsageError(f"--partitions {partitions} is out of range: give 1 to {maximum}")
        if partitions == self.partitions:
            raise UsageError(f"the stream already has {partitions} partitions: give another count")
        return Resize(self, Layout(partitions, self.epoch + 1))


def parse_routing_key(routing_key: str) -> tuple[int, int]:
    """``(epoch, partition)`` of a routing key made by :meth:`Layout.routing_key`;
    ``ValueError`` for any other text (a consumer must not guess an epoch)."""
    epoch_text, dot, partition_text = routing_key.rpartition(".")
    numbers = (epoch_text, partition_text) if dot else ("0", partition_text)
    if not all(text.isascii() and text.isdigit() for text in numbers):
        raise ValueError(f"not a partq routing key: {routing_key!r}")
    epoch, partition = (int(text) for text in numbers)
    if (dot and epoch == 0) or any(len(t) > 1 and t[0] == "0" for t in numbers):
        raise ValueError(f"not a partq routing key (not in its one spelling): {routing_key!r}")
    return epoch, partition


@dataclass(frozen=True, slots=True)
class Resize:
    """The change from layout ``old`` to ``new`` (the next epoch): which old partitions feed
    each new one, which keys move, and what a moved key waits for."""

    old: Layout
    new: Layout

    def __post_init__(self) -> None:
        if self.new.epoch != self.old.epoch + 1:
            raise ValueError(
                f"a resize goes to the next epoch: {self.old.epoch} -> {self.new.epoch}"
            )
        if self.new.partitions == self.old.partitions:
            raise ValueError(f"a resize changes the count: both are {self.new.partitions}")

    @property
    def _gcd(self) -> int:
        return math.gcd(self.old.partitions, self.new.partitions)

    def parents(self, partition: int) -> tuple[int, ...]:
        """The old partitions that hold keys of new ``partition``, ascending."""
        g = self._gcd
        return tuple(range(self.new.check(partition) % g, self.old.partitions, g))

    def children(self, partition: int) -> tuple[int, ...]:
        """The new partitions that old ``partition``'s keys go to, ascending."""
        g = self._gcd
        return tuple(range(self.old.check(partition) % g, self.new.partitions, g))

    def moves(self, key: str | bytes) -> bool:
        """Whether ``key``'s messages change queue (its old and new partitions differ)."""
        return self.old.partition_for(key) != self.new.partition_for(key)

    def gate(self, key: str | bytes) -> int | None:
        """The old partition whose fence ``key``'s new-layout messages wait for; None for a
        key that stays (its old messages are ahead of it in the same queue)."""
        before = self.old.partition_for(key)
        return before if before != self.new.partition_for(key) else None

    def may_handle(self, key: str | bytes, drained: Collection[int]) -> bool:
        """Whether a new-layout message of ``key`` may be handled once the old partitions in
        ``drained`` handled their fence (every old-layout message in them is handled)."""
        waits_for = self.gate(key)
        return waits_for is None or waits_for in drained

    def gated(self, partition: int) -> tuple[int, ...]:
        """The old partitions new ``partition`` waits on for some key: its parents but itself."""
        return tuple(p for p in self.parents(partition) if p != partition)

    @property
    def kept(self) -> range:
        """Queues of both layouts (their old and new messages share the queue)."""
        return range(min(self.old.partitions, self.new.partitions))

    @property
    def added(self) -> range:
        """Queues the new layout adds (a grow): declared before the switch, empty until it."""
        return range(self.old.partitions, max(self.old.partitions, self.new.partitions))

    @property
    def retired(self) -> range:
        """Queues only the old layout has (a shrink): deleted once drained and empty."""
        return range(self.new.partitions, max(self.old.partitions, self.new.partitions))

    @property
    def staying(self) -> Fraction:
        """The fraction of hashes (so of keys, murmur3 being uniform) whose queue is kept."""
        old, new = self.old.partitions, self.new.partitions
        return Fraction(min(old, new), math.lcm(old, new))
