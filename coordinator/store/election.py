"""Leader election for one stream, read like etcd's Go ``concurrency.Election``.

Each campaign puts a candidate key on its session's lease under the stream's leader
prefix (``partq.kernel.keys.leader_candidate``: named by the lease in hex, value empty),
created if absent in one transaction. The candidate with the lowest create revision
leads (:func:`leader`); there is no blocking wait: the coordinator follows the
candidates in its mirror of the group keys and asks :meth:`Election.is_leader` after
every change. A leader's writes are fenced: :meth:`Fence.compare` is the comparison
"our candidate key still has the create revision it was created with", which the
group's store (:class:`partq.coordinator.store.group.Group`, which also puts and deletes the
candidate key) folds into each of the leader's transactions. A deposed leader's key is
gone (its lease
expired, or it resigned), so its writes fail. :meth:`Election.resign` deletes the key
if it is still ours, so the next candidate leads without waiting for the lease.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partq.coordinator.store.session import Session

if TYPE_CHECKING:
    from partq.coordinator.store.group import Group

__all__ = ["Election", "Fence", "leader"]


def leader(candidates: Mapping[str, int]) -> str | None:
    """The candidate (name -> create revision) with the lowest create revision."""
    first = min(candidates.items(), key=lambda kv: kv[1], default=None)
    return None if first is None else first[0]


@dataclass(frozen=True, slots=True)
class Fence:
    """A candidate key and the create revision it had when we put it."""

    key: str
    revision: int

    @property
    def name(self) -> str:
        """The candidate's name: the key after the leader prefix."""
        return self.key.rsplit("/", 1)[1]

    def compare(self, transactions: Any) -> Any:
        """The transaction comparison that holds while this candidate key is the one we put."""
        return transactions.create(self.key) == self.revision


class Election:
    """One stream's election, campaigned in by at most one session at a time; its keys are
    written by the group's store (:meth:`partq.coordinator.store.group.Group.stand`)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.fence: Fence | None = None

    def campaign(self, session: Session) -> Fence:
        """Stand with ``session``'s lease: put our candidate key if absent (else keep the one
        there, ours from before); its create revision orders us among the candidates."""
        self.fence = self.group.stand(session)
        return self.fence

    def is_leader(self, candidates: Mapping[str, int]) -> bool:
        """Whether our candidate leads among ``candidates`` (name -> create revision)."""
        return self.fence is not None and leader(candidates) == self.fence.name

    def resign(self) -> None:
        """Delete our candidate key if it is still the one we put; end the campaign."""
        fence, self.fence = self.fence, None
        if fence is not None:
            self.group.resign(fence)
