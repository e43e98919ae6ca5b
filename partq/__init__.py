"""partq: Kafka-style keyed, ordered, balanced consumer groups for RabbitMQ, coordinated in etcd.

>>> import partq
>>> with partq.Producer("orders") as producer:          # doctest: +SKIP
...     producer.publish("customer-42", b'{"total": 10}').result()
>>> def handle(message: partq.Message) -> None:          # doctest: +SKIP
...     print(message.key, message.body)                 # returning acks the message
>>> partq.run("orders", handle)                          # doctest: +SKIP

The names here are the public API; the subpackages (``partq.producer``,
``partq.consumers``, ``partq.coordinator``, ``partq.kernel``, ``partq.cli``) are
partq's own layout. Each name is imported on first use, so ``import partq`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from partq.kernel import __version__

if TYPE_CHECKING:
    from partq.consumers import Consumer, ConsumerConfig, run
    from partq.consumers.handling.message import Handler, Message
    from partq.kernel.errors import (
        BrokerUnavailable,
        ConnectionLost,
        EtcdError,
        EtcdUnavailable,
        InvalidStreamName,
        MessageNacked,
        MessageUnroutable,
        PartqError,
        ProducerClosed,
        PublishFailed,
        SpecMismatch,
        StreamNotFound,
        UsageError,
    )
    from partq.kernel.settings import Settings
    from partq.producer.async_publisher import AsyncProducer
    from partq.producer.contract import StreamSpec, partition_for, queue_name
    from partq.producer.ledger import Receipt
    from partq.producer.publisher import Producer

_ERRORS = (
    "BrokerUnavailable",
    "ConnectionLost",
    "EtcdError",
    "EtcdUnavailable",
    "InvalidStreamName",
    "MessageNacked",
    "MessageUnroutable",
    "PartqError",
    "ProducerClosed",
    "PublishFailed",
    "SpecMismatch",
    "StreamNotFound",
    "UsageError",
)
# public name -> the module that defines it
_HOMES: dict[str, str] = {
    "AsyncProducer": "partq.producer.async_publisher",
    "Consumer": "partq.consumers",
    "ConsumerConfig": "partq.consumers",
    "Handler": "partq.consumers.handling.message",
    "Message": "partq.consumers.handling.message",
    "Producer": "partq.producer.publisher",
    "Receipt": "partq.producer.ledger",
    "Settings": "partq.kernel.settings",
    "StreamSpec": "partq.producer.contract",
    "partition_for": "partq.producer.contract",
    "queue_name": "partq.producer.contract",
    "run": "partq.consumers",
    **dict.fromkeys(_ERRORS, "partq.kernel.errors"),
}

__all__ = [
    "AsyncProducer",
    "BrokerUnavailable",
    "ConnectionLost",
    "Consumer",
    "ConsumerConfig",
    "EtcdError",
    "EtcdUnavailable",
    "Handler",
    "InvalidStreamName",
    "Message",
    "MessageNacked",
    "MessageUnroutable",
    "PartqError",
    "Producer",
    "ProducerClosed",
    "PublishFailed",
    "Receipt",
    "Settings",
    "SpecMismatch",
    "StreamNotFound",
    "StreamSpec",
    "UsageError",
    "__version__",
    "partition_for",
    "queue_name",
    "run",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'partq' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
