"""Who may ask a consumer to redrive or purge a parked key (``partq dlq``).

A control message is an ordinary message in the key's partition queue, so anything that can
publish into the stream could send one. It is obeyed only when its ``user_id`` property names
one of the stream's control senders: RabbitMQ refuses a publish whose ``user_id`` differs
from the publishing connection's user (``PRECONDITION_FAILED``), so the property cannot be
forged by a producer. The senders are the users of the stream's operator and admin roles
(``partq security roles``) and the consumer's own user: in a deployment where every
component shares one user, whoever holds it may purge queues directly anyway, and in a
least-privilege one a consumer's user cannot publish into a partition queue. Pure: no I/O.

Threads. None: called on a partition's worker thread with values it alone holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pika
from partq.producer.contract import CONTROL_ROLES, role_name

from partq.kernel import keys
from partq.kernel.amqp import AmqpURL, targets
from partq.kernel.errors import PartqError

__all__ = ["ForgedControl", "senders", "verify"]


class ForgedControl(PartqError):
    """A control message from a user that may not send one (the dead letter's error type)."""


def senders(scope: str, own_users: Iterable[str | None] = ()) -> frozenset[str]:
    """The users whose control messages the consumers of the group ``scope`` names obey:
    the group's operator and the stream's admin (``partq security roles``)."""
    stream = keys.stream_of(scope)
    found = {role_name(scope if role != "admin" else stream, role) for role in CONTROL_ROLES}
    return frozenset(found | {u for u in own_users if u})


def users_of(url: AmqpURL) -> list[str | None]:
    """The user of each entry of ``url`` (None for a certificate login: SASL EXTERNAL)."""
    found: list[str | None] = []
    for entry in targets(url):
        if entry.tls.external_auth:
            found.append(None)
            continue
        credentials = pika.URLParameters(entry.url).credentials
        found.append(getattr(credentials, "username", None))
    return found


def verify(action: Any, user_id: Any, allowed: frozenset[str]) -> None:
    """Raise :class:`ForgedControl` unless ``user_id`` is one of the ``allowed`` senders."""
    user = user_id.decode(errors="replace") if isinstance(user_id, bytes) else user_id
    if not isinstance(user, str) or user not in allowed:
        raise ForgedControl(
            f"control message {action!r} sent by user {user!r}, not by the stream's operator "
            f"or admin ({', '.join(sorted(allowed))}): not obeyed"
        )
