"""partq's producer side: the wire contract and the producer SDK.

This package imports neither ``coordinator`` nor ``consumers``.
"""

from partq.producer.async_publisher import AsyncProducer
from partq.producer.contract import (
    StreamSpec,
    dead_letter_queue,
    exchange_name,
    partition_for,
    queue_name,
    queue_pattern,
    validate_stream_name,
)
from partq.producer.ledger import Receipt
from partq.producer.publisher import Producer, SpecSource

from partq.kernel.amqp import DEFAULT_AMQP_URL, redact_url
from partq.kernel.errors import (
    BrokerUnavailable,
    ConnectionLost,
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

__all__ = [
    "DEFAULT_AMQP_URL",
    "AsyncProducer",
    "BrokerUnavailable",
    "ConnectionLost",
    "InvalidStreamName",
    "MessageNacked",
    "MessageUnroutable",
    "PartqError",
    "Producer",
    "ProducerClosed",
    "PublishFailed",
    "Receipt",
    "SpecMismatch",
    "SpecSource",
    "StreamNotFound",
    "StreamSpec",
    "UsageError",
    "dead_letter_queue",
    "exchange_name",
    "partition_for",
    "queue_name",
    "queue_pattern",
    "redact_url",
    "validate_stream_name",
]
