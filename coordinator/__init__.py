"""partq's coordinator: the etcd layer, the assignor, leader election and the service."""

from coordinator.errors import EtcdUnavailable, LeaseLost, MemberIdTaken, NotLeader
from coordinator.settings import Settings
from coordinator.streams import Registry

__all__ = ["EtcdUnavailable", "LeaseLost", "MemberIdTaken", "NotLeader", "Registry", "Settings"]
