"""The coordinator's errors, extending :mod:`producer.errors`.

::

    PartqError                       (producer.errors)
    ├── UsageError
    │   └── MemberIdTaken            a live consumer already uses this member id
    └── EtcdUnavailable              etcd cannot be reached, refused us, or timed out
        └── LeaseLost                our lease expired or was revoked
    NotLeader                        (PartqError) a fenced write found another leader

etcd3/grpc errors are translated by :func:`coordinator.etcd.etcd_errors`.
"""

from __future__ import annotations

from producer.errors import PartqError, UsageError

__all__ = ["EtcdUnavailable", "LeaseLost", "MemberIdTaken", "NotLeader"]


class EtcdUnavailable(PartqError):
    pass


class LeaseLost(EtcdUnavailable):
    pass


class MemberIdTaken(UsageError):
    pass


class NotLeader(PartqError):
    pass
