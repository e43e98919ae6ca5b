"""The coordinator's errors, extending :mod:`producer.errors`.

::

    PartqError                       (producer.errors)
    ├── UsageError
    │   ├── MemberIdTaken            a live consumer already uses this member id
    │   └── InvalidMemberId          not in coordinator.codec's member id character set
    ├── MalformedValue               (producer.errors) a value in etcd partq did not write
    └── EtcdUnavailable              etcd cannot be reached, refused us, or timed out
        ├── EtcdAuthFailed           wrong etcd user or password, or etcd wants one
        ├── EtcdTLSError             a certificate not trusted, or a client one required/refused
        └── EtcdPermissionDenied     the etcd user's roles do not allow this key
    NotLeader                        (PartqError) a fenced write found another leader

A lost lease is not an error: ``Session.lost`` is set (and ``on_lost`` called).
etcd3/grpc errors are translated by :func:`coordinator.etcd.etcd_errors`.
"""

from __future__ import annotations

from producer.errors import PartqError, UsageError

__all__ = [
    "EtcdAuthFailed",
    "EtcdPermissionDenied",
    "EtcdTLSError",
    "EtcdUnavailable",
    "InvalidMemberId",
    "MemberIdTaken",
    "NotLeader",
]


class EtcdUnavailable(PartqError):
    pass


class EtcdAuthFailed(EtcdUnavailable):
    """etcd refused the user name or password (or requires one and none was given)."""


class EtcdTLSError(EtcdUnavailable):
    """The TLS handshake failed: etcd's certificate is not trusted by our CA file, does not
    name the host, or etcd requires (or refused) our client certificate."""


class EtcdPermissionDenied(EtcdUnavailable):
    """Authenticated, but the user's roles do not grant this operation on this key."""


class MemberIdTaken(UsageError):
    pass


class InvalidMemberId(UsageError):
    pass


class NotLeader(PartqError):
    pass
