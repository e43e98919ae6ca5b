"""Sticky, weighted, deterministic assignment of partitions to consumer-group members.

Pure functions only: no I/O, no clocks, no randomness, stdlib imports only.

Rules implemented by :func:`assign` (``P`` partitions, member weights ``w_m``, ``W = sum(w_m)``):

1. **Balance.** Every member ``m`` ends up with ``q_m`` partitions, where ``q_m`` is either
   ``floor(P * w_m / W)`` or ``ceil(P * w_m / W)``, computed exactly with integers. Exactly
   ``P - sum(floors)`` of the members whose share is fractional get the ceil.
2. **Who gets the ceil.** Among members with a fractional share, those that currently hold *more*
   than their floor come first (giving them the extra slot saves them a move), then the ones
   holding most relative to their floor, then ascending member id. This choice maximises the
   number of partitions that stay put, ``sum(min(c_m, q_m))`` where ``c_m`` is what ``m`` holds.
3. **Stickiness.** A partition stays with its current owner if that owner is still a member and
   is within its quota. An over-quota member gives up its *highest-numbered* partitions until it
   is at quota. Partitions outside ``0..P-1`` in ``current`` are ignored.
4. **Hand-out.** The freed partitions plus the orphaned ones (no owner, or owner gone) are sorted
   ascending and dealt out to the under-quota members in ascending member-id order, each member
   taking as many consecutive ones as it is short.

Consequently the number of partitions taken from a live owner is ``sum(max(0, c_m - q_m))``, the
minimum any balanced assignment allows. With *equal* weights, adding one member to a balanced
assignment only moves partitions to the new member, and removing one member only moves that
member's partitions (the ceil slots always fit the members that already hold a ceil).

The result depends only on the *contents* of the inputs, never on the insertion order of the
mappings: every iteration below goes through ``sorted(...)``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["assign", "limit_moves", "moves"]


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is a subclass of int; True as a weight or partition count is almost surely a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _quotas(partitions: int, members: Mapping[str, int], held: Mapping[str, int]) -> dict[str, int]:
    """Per-member quota: floor of the exact share, plus one for the best-placed fractional ones."""
    total = sum(members.values())
    quota: dict[str, int] = {}
    fractional: list[str] = []
    # Sorted iteration: dict order is insertion order, which must not leak into the result.
    for member in sorted(members):
        floor, rest = divmod(partitions * members[member], total)
        quota[member] = floor
        if rest:
            fractional.append(member)
    extra = partitions - sum(quota.values())  # 0 <= extra <= len(fractional)

    def priority(member: str) -> tuple[bool, int, str]:
        surplus = held.get(member, 0) - quota[member]
        # False sorts first: members already holding more than their floor win the extra slot.
        return (surplus <= 0, -surplus, member)

    for member in sorted(fractional, key=priority)[:extra]:
        quota[member] += 1
    return quota


def assign(
    partitions: int, members: Mapping[str, int], current: Mapping[int, str]
) -> dict[int, str]:
    """Assign every partition ``0..partitions-1`` to a member of ``members``.

    ``members`` maps member id -> weight (an int >= 1); ``current`` maps partition -> owner and may
    be partial, name members that are gone, or contain partitions outside ``0..partitions-1``
    (those are ignored). The result is balanced (every member gets the floor or the ceil of its
    weighted share), moves the fewest partitions that balance allows, and is deterministic; see the
    module docstring for the exact rules.

    Raises ``ValueError`` if ``partitions < 1``, if ``members`` is empty, or if a weight is not an
    integer >= 1 (the message names the member).
    """
    _check_int("partitions", partitions, 1)
    if not members:
        raise ValueError(
            "no members: cannot assign partitions to an empty group; "
            "wait until at least one consumer has joined (registered itself) before assigning"
        )
    for member in sorted(members):
        _check_int(f"weight of member {member!r}", members[member], 1)

    # What each live member holds now, in ascending partition order. Iterating range(P) rather
    # than `current` keeps the order independent of how `current` was built.
    holdings: dict[str, list[int]] = {}
    pool: list[int] = []  # partitions needing a new owner: orphaned now, freed below
    for p in range(partitions):
        owner = current.get(p)
        if owner is not None and owner in members:
            holdings.setdefault(owner, []).append(p)
        else:
            pool.append(p)

    quota = _quotas(partitions, members, {m: len(ps) for m, ps in holdings.items()})

    result: dict[int, str] = {}
    for member in sorted(holdings):
        held = holdings[member]
        keep = min(len(held), quota[member])
        for p in held[:keep]:
            result[p] = member
        pool.extend(held[keep:])  # over quota: give up the highest-numbered partitions

    # Never pick from a set or rely on dict order here: both would make the outcome depend on
    # hashing or on insertion order. Sorted pool, sorted members -> one answer per input.
    pool.sort()
    i = 0
    for member in sorted(members):
        short = quota[member] - len(holdings.get(member, ()))
        if short > 0:
            for p in pool[i : i + short]:
                result[p] = member
            i += short
    assert i == len(pool), "quota bookkeeping is inconsistent"  # sum(quota) == partitions
    return {p: result[p] for p in range(partitions)}


def moves(
    current: Mapping[int, str], target: Mapping[int, str]
) -> list[tuple[int, str | None, str]]:
    """Sorted list of (partition, old_owner_or_None, new_owner) where target differs from current.

    Only partitions that are keys of ``target`` are considered; a partition that is in ``current``
    but not in ``target`` is not a move.
    """
    return [(p, current.get(p), target[p]) for p in sorted(target) if current.get(p) != target[p]]


def limit_moves(
    current: Mapping[int, str], target: Mapping[int, str], max_moves: int | None
) -> dict[int, str]:
    """A step toward target: at most max_moves partitions that currently HAVE an owner change owner.

    Partitions with no current owner (absent from ``current``) are always assigned at once: they
    are not "in motion". ``None`` = no limit. Deterministic (lowest partition numbers first).

    The result has exactly the keys of ``target``. A partition keeps its ``current`` owner unless it
    is absent from ``current`` (then it gets its target owner at once) or it is among the
    ``max_moves`` lowest-numbered partitions whose owner differs. This function cannot tell a dead
    owner from a live one: the caller should drop partitions of departed members from ``current``
    first, or they count against ``max_moves`` like any other move. Repeated application reaches
    ``target`` in ``ceil(len(moves) / max_moves)`` steps. Raises ``ValueError`` if
    ``max_moves < 0``.
    """
    if max_moves is not None:
        _check_int("max_moves", max_moves, 0)
    step: dict[int, str] = {}
    budget = max_moves
    for p in sorted(target):
        old = current.get(p)
        new = target[p]
        if old is None or old == new:
            step[p] = new
        elif budget is None or budget > 0:
            step[p] = new
            if budget is not None:
                budget -= 1
        else:
            step[p] = old
    return step
