"""partq's errors. Every error partq raises is a :class:`PartqError`.

::

    PartqError
    ├── UsageError                 bad input or settings: fix the call (CLI exit code 2)
    │   ├── InvalidStreamName
    │   ├── SpecMismatch           configured partitions disagree with the stored spec
    │   ├── MemberIdTaken          a live consumer already uses this member id
    │   └── InvalidMemberId        not in partq.coordinator.store.codec's member id character set
    ├── StreamNotFound             no spec in etcd: create the stream first
    ├── MalformedValue             a value in etcd is not what partq writes (also a ValueError)
    ├── BrokerUnavailable        ↻ RabbitMQ cannot be reached or refused us
    │   └── BrokerRefused        ↻ it refused the login, the virtual host or a resource
    ├── EtcdError                  etcd did not do what was asked
    │   ├── EtcdUnavailable      ↻ etcd cannot be reached, or timed out
    │   ├── EtcdCompacted        ↻ the revision asked for is compacted away: read afresh
    │   └── EtcdRefused            etcd answered no: fix the credentials or the role
    │       ├── EtcdAuthFailed     wrong etcd user or password, or etcd wants one
    │       ├── EtcdTLSError       a certificate not trusted, or a client one required/refused
    │       └── EtcdPermissionDenied  the etcd user's roles do not allow this key
    ├── NotLeader                ↻ a fenced write found another leader: campaign again
    ├── NotHolder                  a write for a partition whose claim is no longer ours
    ├── PublishFailed              a message was not confirmed (its future fails with this)
    │   ├── MessageNacked
    │   ├── MessageUnroutable
    │   └── ConnectionLost
    └── ProducerClosed

↻ marks the retryable errors (:attr:`PartqError.retryable`): the same call may work
later unchanged, so a retry loop waits and tries again. Every other error is final
for the loop: it asks :func:`retryable` and re-raises the rest, which end the process
with their one line. An etcd that refuses the user, its certificate or a key is not
retried: nothing changes until an operator fixes the credentials or the role, and a
loop retrying it would hide the line that says what to fix.

A lost lease is not an error: ``Session.lost`` is set (and ``on_lost`` called).
This is the one tree for every package. Library errors (pika's, etcd3's,
grpc's) are translated where they are raised (:mod:`partq.kernel.amqp`,
:mod:`partq.kernel.etcd`), so callers only ever see these, each with a message that
says what to do.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "BrokerRefused",
    "BrokerUnavailable",
    "ConnectionLost",
    "EtcdAuthFailed",
    "EtcdCompacted",
    "EtcdError",
    "EtcdPermissionDenied",
    "EtcdRefused",
    "EtcdTLSError",
    "EtcdUnavailable",
    "InvalidMemberId",
    "InvalidStreamName",
    "MalformedValue",
    "MemberIdTaken",
    "MessageNacked",
    "MessageUnroutable",
    "NotHolder",
    "NotLeader",
    "PartqError",
    "ProducerClosed",
    "PublishFailed",
    "SpecMismatch",
    "StreamNotFound",
    "UsageError",
    "exit_code",
    "retryable",
]

EXIT_FAILURE = 1  # a runtime failure: etcd or RabbitMQ unreachable, no such stream, ...
EXIT_USAGE = 2  # bad input or settings: the caller has to change something


class PartqError(Exception):
    """Base of every partq error."""

    retryable: ClassVar[bool] = False
    """True when the same call may work later unchanged (a server away, a lost race)."""


def retryable(error: BaseException) -> bool:
    """Whether a retry loop should try again after ``error``: only a retryable
    :class:`PartqError`; anything else (a refusal, a bug) is for the caller to see."""
    return isinstance(error, PartqError) and error.retryable


class UsageError(PartqError, ValueError):
    """The input or the settings are wrong; fix them and try again."""


class InvalidStreamName(UsageError):
    pass


class SpecMismatch(UsageError):
    pass


class StreamNotFound(PartqError):
    pass


class MalformedValue(PartqError, ValueError):
    """A value stored in etcd is not one partq writes (not JSON, or the wrong shape)."""


class BrokerUnavailable(PartqError):
    retryable = True


class BrokerRefused(BrokerUnavailable):
    """RabbitMQ answered and refused: the login, the virtual host or a queue. Still retried
    by the daemons (an operator may fix the user while they wait); a one-shot command such
    as ``partq status`` says so instead of carrying on without the broker."""


class PublishFailed(PartqError):
    """The broker did not confirm the message: it may not have been stored."""


class MessageNacked(PublishFailed):
    pass


class MessageUnroutable(PublishFailed):
    pass


class ConnectionLost(PublishFailed):
    pass


class ProducerClosed(PartqError):
    pass


class EtcdError(PartqError):
    """etcd did not do what was asked: :class:`EtcdUnavailable`, :class:`EtcdCompacted` or
    :class:`EtcdRefused`."""


class EtcdUnavailable(EtcdError):
    """etcd cannot be reached or did not answer in time: try again later."""

    retryable = True


class EtcdCompacted(EtcdError):
    """A read or a watch asked for a revision etcd has compacted away: that history is
    gone for good, so the same call fails again; what works is a fresh read (a watch
    resyncs from one, a judgement of the past gives up)."""

    retryable = True


class EtcdRefused(EtcdError):
    """etcd answered and refused: retrying cannot help until the credentials or the
    role change. The message says what to change."""


class EtcdAuthFailed(EtcdRefused):
    """etcd refused the user name or password (or requires one and none was given)."""


class EtcdTLSError(EtcdRefused):
    """The TLS handshake failed: etcd's certificate is not trusted by our CA file, does not
    name the host, or etcd requires (or refused) our client certificate."""


class EtcdPermissionDenied(EtcdRefused):
    """Authenticated, but the user's roles do not grant this operation on this key."""


class MemberIdTaken(UsageError):
    pass


class InvalidMemberId(UsageError):
    pass


class NotLeader(PartqError):
    """Deposed: another candidate leads now. The next campaign may win."""

    retryable = True


class NotHolder(PartqError):
    pass


def exit_code(error: PartqError) -> int:
    """The process exit code for ``error``: 2 for a usage error, else 1."""
    return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILURE
