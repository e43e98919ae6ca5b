"""Lag-aware assignment (``partq coordinator --balance load``): pure, stdlib only.

A partition's *load* is the work it brings per second, in messages: what its consumers
handled per second (their reports, :class:`partq.coordinator.store.codec.LoadReport`), plus how fast
its queue grew (arrivals the owner did not keep up with), plus its backlog spread over
``horizon`` seconds (so a partition that fell behind counts as hotter until it caught
up): :func:`estimate`. A member's load is the sum of its partitions' loads divided by its
weight.

:func:`spread` moves partitions from the most to the least loaded member while that
lowers the higher of the two by a clear margin, at most ``max_moves`` partitions a call:

1. **Orphans first.** Partitions without a live owner go, hottest first, each to the
   member with the least load (then the fewest partitions, then the lowest id).
2. **Hot to cold.** Then the best single move or swap between the most and the least
   loaded member is made, as long as it lowers the higher of their two loads by at least
   ``margin`` (half) of the mean partition load (smaller wins are noise in measured
   rates, and a move costs a handoff). A swap counts two moves against ``max_moves``.
   The most loaded member's load never rises.

Every partition carries at least ``floor`` of the mean partition load (at least a
thousandth of a message per second), so partitions that carry nothing are still spread
by count: with no reports at all, :func:`spread` balances counts to within one, as the
count-based assignor does.
Deterministic: members and partitions are always visited in sorted order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["estimate", "member_loads", "smooth", "spread"]


def estimate(
    rates: Mapping[int, float],
    depths: Mapping[int, int],
    previous: Mapping[int, int],
    elapsed: float,
    horizon: float,
) -> dict[int, float]:
    """Each partition's load in messages per second (module docstring).

    ``rates``: messages handled per second, summed over the members that reported it;
    ``depths``: ready messages now; ``previous``: ready messages ``elapsed`` seconds ago
    (growth is left out where either is unknown or ``elapsed`` is not positive).
    """
    out: dict[int, float] = {}
    for p in sorted(set(rates) | set(depths)):
        load = max(0.0, rates.get(p, 0.0))
        depth = depths.get(p)
        if depth is not None:
            before = previous.get(p)
            if before is not None and elapsed > 0:
                load += max(0.0, (depth - before) / elapsed)
            if horizon > 0:
                load += max(0, depth) / horizon
        out[p] = load
    return out


def smooth(
    before: Mapping[int, float], now: Mapping[int, float], weight: float = 0.5
) -> dict[int, float]:
    """An exponential moving average: ``weight`` of the new estimate, the rest of the
    previous one (a partition new to either side takes the value it has)."""
    out: dict[int, float] = {}
    for p in sorted(set(before) | set(now)):
        if p in before and p in now:
            out[p] = weight * now[p] + (1 - weight) * before[p]
        else:
            out[p] = now[p] if p in now else before[p]
    return out


def member_loads(
    owners: Mapping[int, str], loads: Mapping[int, float], weights: Mapping[str, int]
) -> dict[str, float]:
    """Each member's load (sum of its partitions' loads) divided by its weight."""
    total = dict.fromkeys(sorted(weights), 0.0)
    for p, member in sorted(owners.items()):
        if member in total:
            total[member] += loads.get(p, 0.0)
    return {m: total[m] / weights[m] for m in total}


def _check(weights: Mapping[str, int], max_moves: int | None) -> None:
    if not weights:
        raise ValueError("no members: wait until a consumer has joined before assigning")
    for member in sorted(weights):
        if isinstance(weights[member], bool) or weights[member] < 1:
            raise ValueError(f"weight of member {member!r} must be at least 1")
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")


def spread(  # noqa: C901 — one algorithm over one state: fill, then level within the budget
    partitions: int,
    weights: Mapping[str, int],
    current: Mapping[int, str],
    loads: Mapping[int, float],
    *,
    max_moves: int | None = None,
    margin: float = 0.5,
    floor: float = 0.05,
) -> dict[int, str]:
    """Every partition ``0..partitions-1`` given to a member of ``weights`` (module docstring).

    ``current`` may name members that are gone and partitions outside the stream (both
    ignored); ``loads`` may lack partitions (they carry the floor). Raises ``ValueError``
    for no members, a weight below 1 or a negative ``max_moves``.

    Loads are counted in whole thousandths of a message per second and members' loads
    compared exactly (scaled by the weights' least common multiple): with float sums, the
    order in which partitions were added decided ties, and spreading a result again could
    move a partition.
    """
    _check(weights, max_moves)
    measured = [_milli(loads.get(p, 0.0)) for p in range(partitions)]
    least = max(1, int(floor * sum(measured) / partitions))
    load = [max(least, x) for x in measured]
    mean_partition = sum(load) / partitions
    common = math.lcm(*weights.values())
    scale = {m: common // weights[m] for m in sorted(weights)}  # level = total * scale

    owner: dict[int, str] = {}
    held: dict[str, list[int]] = {m: [] for m in sorted(weights)}
    total = dict.fromkeys(held, 0)
    for p in range(partitions):
        m = current.get(p)
        if m in held:
            owner[p] = m
            held[m].append(p)
            total[m] += load[p]

    def level(m: str) -> int:
        return total[m] * scale[m]

    def give(p: int, to: str) -> None:
        was = owner.get(p)
        if was is not None:
            held[was].remove(p)
            total[was] -= load[p]
        owner[p] = to
        held[to].append(p)
        total[to] += load[p]

    for p in sorted((p for p in range(partitions) if p not in owner), key=lambda p: (-load[p], p)):
        give(p, min(held, key=lambda m: (level(m), len(held[m]), m)))

    budget = max_moves
    for _ in range(2 * partitions):  # each step lowers the hot member's load: bounded anyway
        if budget is not None and budget <= 0:
            break
        hot = max(held, key=lambda m: (level(m), m))
        cold = min(held, key=lambda m: (level(m), m))
        if hot == cold:
            break
        best = _best_step(held[hot], held[cold], load, (level(hot), level(cold)),
                          (scale[hot], scale[cold]), budget)  # fmt: skip
        if best is None or level(hot) - best[0] < margin * mean_partition * scale[hot]:
            break
        _, out, back = best
        give(out, cold)
        if back is not None:
            give(back, hot)
        if budget is not None:
            budget -= 1 if back is None else 2
    return {p: owner[p] for p in range(partitions)}


def _milli(rate: float) -> int:
    """A load in whole thousandths of a message per second (0 for anything not a finite
    positive number)."""
    return round(rate * 1000) if math.isfinite(rate) and rate > 0 else 0


def _best_step(
    hot: list[int],
    cold: list[int],
    load: list[int],
    levels: tuple[int, int],
    scales: tuple[int, int],
    budget: int | None,
) -> tuple[int, int, int | None] | None:
    """The move (hot → cold) or swap that leaves the lower maximum of the two members'
    scaled loads: (that maximum, the partition given, the partition taken back or None).
    Ties go to a move over a swap, then to the lowest partition numbers."""
    (hot_level, cold_level), (hot_scale, cold_scale) = levels, scales
    best: tuple[int, int, int, int] | None = None  # (new max, 0 move / 1 swap, out, back)
    for out in sorted(hot):
        after = (hot_level - load[out] * hot_scale, cold_level + load[out] * cold_scale)
        candidate = (max(after), 0, out, -1)
        if best is None or candidate < best:
            best = candidate
        if budget is not None and budget < 2:
            continue
        for back in sorted(cold):
            delta = load[out] - load[back]
            if delta <= 0:
                continue
            after = (hot_level - delta * hot_scale, cold_level + delta * cold_scale)
            candidate = (max(after), 1, out, back)
            best = min(best, candidate)
    if best is None:
        return None
    return best[0], best[2], (best[3] if best[1] else None)
