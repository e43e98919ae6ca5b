"""Members played by bare etcd sessions, for coordinator tests (fake and real etcd alike),
and a consumer's partitions with no broker and no daemon (``bare_partitions``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

from partq.consumers.broker.deadletters import DeadLetters
from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.crew import Crew
from partq.consumers.control.partitions import Partitions
from partq.consumers.handling.message import Message
from partq.coordinator.store.group import Claim, Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

__all__ = ["bare_partitions", "claim_assigned", "claim_live"]


def _ignore(_message: Message) -> None:
    pass


def bare_partitions(
    spec: StreamSpec,
    member: str,
    group: Group,
    broker: object,
    settle_takeover: Callable[[int], None] = lambda _p: None,
) -> Partitions:
    """``member``'s partitions on ``broker`` (a recorder), with a handler that does nothing,
    one attempt per message and no retries, dead letters, resync or release retries."""
    crew = Crew(
        member=member,
        handler=_ignore,
        broker=cast(BrokerPort, broker),
        dead_letters=cast(DeadLetters, None),
        max_attempts=1,
        retry_backoff=0.01,
        handler_timeout=None,
        on_failure=lambda _p, _r: None,
        parking=None,
        resize=None,
        concurrency=1,
        fence_wait=0.0,
    )
    return Partitions(
        spec=spec,
        member=member,
        group=group,
        broker=cast(BrokerPort, broker),
        crew=crew,
        retry_release=lambda _p: None,
        resync=lambda: None,
        settle_takeover=settle_takeover,
    )


def claim_assigned(group: Group, sessions: Mapping[str, Session]) -> None:
    """Each member claims what is assigned to it, as consumers do (after the old owner releases)."""
    state = group.snapshot()
    for partition, owner in sorted(state.assignment.items()):
        claim = state.claims.get(partition)
        if claim is not None and claim.member != owner and claim.member in sessions:
            group.release(partition, sessions[claim.member])
        if owner in sessions:
            group.claim(partition, owner, sessions[owner])


def claim_live(group: Group, partition: int, member: str, session: Session) -> int:
    """``member`` claims ``partition`` and marks the claim live, as a consumer does once its
    subscription is confirmed (a hot standby stands behind live claims only); the revision."""
    revision = group.claim(partition, member, session)
    assert revision > 0, f"{member} could not claim partition {partition}"
    return group.mark_live(partition, session, Claim(member, session.id))
