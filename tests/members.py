"""Members played by bare etcd sessions, for coordinator tests (fake and real etcd alike)."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.group import Group
from coordinator.session import Session

__all__ = ["claim_assigned"]


def claim_assigned(group: Group, sessions: Mapping[str, Session]) -> None:
    """Each member claims what is assigned to it, as consumers do (after the old owner releases)."""
    state = group.snapshot()
    for partition, owner in sorted(state.assignment.items()):
        claim = state.claims.get(partition)
        if claim is not None and claim.member != owner and claim.member in sessions:
            group.release(partition, sessions[claim.member])
        if owner in sessions:
            group.claim(partition, owner, sessions[owner])
