"""partq's coordinator: the etcd layer, the assignor, leader election and the service."""

from coordinator.errors import EtcdUnavailable, MemberIdTaken, NotLeader
from coordinator.settings import Settings
from coordinator.streams import Registry

__all__ = ["EtcdUnavailable", "MemberIdTaken", "NotLeader", "Registry", "Settings"]
