"""partq's coordinator: the etcd layer, the assignor, leader election and the service."""

from kernel.errors import EtcdUnavailable, MemberIdTaken, NotLeader
from kernel.settings import Settings
from producer.registry import Registry

__all__ = ["EtcdUnavailable", "MemberIdTaken", "NotLeader", "Registry", "Settings"]
