"""The coordinator's errors, extending :mod:`producer.errors`.

::

    PartqError                       (producer.errors)
    ├── UsageError
    │   ├── MemberIdTaken            a live consumer already uses this member id
    │   └── InvalidMemberId          not in coordinator.codec's member id character set
    ├── MalformedValue               (producer.errors) a value in etcd partq did not write
    └── EtcdUnavailable              etcd cannot be reached, refused us, or timed out
    NotLeader                        (PartqError) a fenced write found another leader

A lost lease is not an error: ``Session.lost`` is set (and ``on_lost`` called).
etcd3/grpc errors are translated by :func:`coordinator.etcd.etcd_errors`.
"""

from __future__ import annotations

from producer.errors import PartqError, UsageError

__all__ = ["EtcdUnavailable", "InvalidMemberId", "MemberIdTaken", "NotLeader"]


class EtcdUnavailable(PartqError):
    pass


class MemberIdTaken(UsageError):
    pass


class InvalidMemberId(UsageError):
    pass


class NotLeader(PartqError):
    pass
