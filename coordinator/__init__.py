"""partq's coordinator: the etcd layer, the assignor, leader election and the service."""

from partq.producer.registry import Registry

from partq.kernel.errors import EtcdUnavailable, MemberIdTaken, NotLeader
from partq.kernel.settings import Settings

__all__ = ["EtcdUnavailable", "MemberIdTaken", "NotLeader", "Registry", "Settings"]
