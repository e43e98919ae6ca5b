"""The wire contract every partq component shares.

One place for each fact: the hash (:func:`partition_for`), the names of a
stream's exchange and queues (:func:`queue_name` and friends), the message
headers (:data:`HEADER_KEY` …) and the stream spec (:class:`StreamSpec`).
Pure: no I/O.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import mmh3

from partq.kernel import keys
from partq.kernel.errors import InvalidStreamName, MalformedValue, SpecMismatch, UsageError

if TYPE_CHECKING:
    from partq.producer.layout import Layout

__all__ = [
    "CONTROL_FENCE",
    "CONTROL_FILL",
    "DEAD_LETTER_HEADERS",
    "HEADER_ATTEMPTS",
    "HEADER_CONTROL",
    "HEADER_EPOCH",
    "HEADER_ERROR",
    "HEADER_ERROR_TYPE",
    "HEADER_FAILED_MS",
    "HEADER_FAILED_PARTITION",
    "HEADER_GROUP",
    "HEADER_KEY",
    "HEADER_KEY_B64",
    "HEADER_MEMBER",
    "HEADER_PARTITION",
    "HEADER_PUBLISHED_MS",
    "HEADER_SEAL",
    "MAX_PARTITIONS",
    "ON_FAILURE",
    "QUORUM_DELIVERY_LIMIT",
    "OnFailure",
    "QueueType",
    "StreamSpec",
    "check_partition_count",
    "dead_letter_exchange",
    "dead_letter_queue",
    "decode_key",
    "encode_key",
    "exchange_name",
    "fence_routing_key",
    "group_scope",
    "is_seal",
    "key_bytes",
    "key_from_id",
    "key_id",
    "long_key_id",
    "park_exchange",
    "park_queue",
    "park_queue_pattern",
    "partition_exchange",
    "partition_for",
    "queue_name",
    "queue_pattern",
    "refuse_control_headers",
    "refuse_overlap",
    "role_name",
    "seal_digest",
    "split_scope",
    "validate_group_name",
    "validate_stream_name",
]

QueueType = Literal["quorum", "classic"]
QUEUE_TYPES: tuple[QueueType, ...] = ("quorum", "classic")
# What a consumer does with a message that exhausted its retries: park its key (that message
# and every later one of the key wait, in order, in the key's parking queue, until redriven)
# or dead-letter the message alone (later messages of the key overtake it).
OnFailure = Literal["park", "dead-letter"]
ON_FAILURE: tuple[OnFailure, ...] = ("park", "dead-letter")
MAX_PARTITIONS = 65_536
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_NAME_MAX = 100
_PREFIX = "partq"
# A stream's groups (docs/groups.md): each its own queues and etcd keys, named by its scope
DEFAULT_GROUP = "default"
GROUP_SEPARATOR = keys.GROUP_SEPARATOR

HEADER_KEY = "partq-key"
HEADER_KEY_B64 = "partq-key-b64"
HEADER_PARTITION = "partq-partition"
HEADER_PUBLISHED_MS = "partq-published-ms"
# A control message of `partq dlq` for the key in its headers: "redrive" or "purge". The
# partition's worker acts on it in queue order and never hands it to the handler.
HEADER_CONTROL = "x-partq-control"
# A resize's fence (docs/resize.md): HEADER_CONTROL = CONTROL_FENCE and the old layout's
# epoch in HEADER_EPOCH, published on routing key ``fence_routing_key(epoch, partition)``.
# The last old-layout message of its queue: its consumer records it handled in etcd
# (partq.kernel.keys.drained) and never hands it to the handler.
CONTROL_FENCE = "fence"
# A drain's filler (consumers/broker/fillers.py): an empty message a draining consumer publishes
# into its own queue through the dead-letter exchange, so that its prefetch window fills.
# What marks one is that exchange (a consumer acks every delivery that came through it,
# unhandled); this header only names it to a person looking at a queue.
CONTROL_FILL = "fill"
HEADER_EPOCH = "x-partq-epoch"
# The one group a redriven dead letter or a `partq dlq` control message is for: it reaches
# every group's partition queue through the stream's exchange, and the other groups' consumers
# ack it unhandled (docs/groups.md). Producers may not send it.
HEADER_GROUP = "x-partq-group"
# A fence's seal: a random token the resize publishes only in the fence and records in
# etcd only as its digest (seal_digest), so a drained record carrying it was written by
# whoever consumed the fence, never forged from what etcd shows (docs/resize.md).
HEADER_SEAL = "x-partq-seal"
_SEAL = re.compile(r"[0-9a-f]{32}")
# Written on a dead letter by the consumer that gave up on it (consumers/handling/worker.py): why,
# after how many handler attempts, from which partition, by which member, when (ms).
HEADER_ERROR = "x-partq-error"
HEADER_ERROR_TYPE = "x-partq-error-type"
HEADER_ATTEMPTS = "x-partq-attempts"
HEADER_FAILED_PARTITION = "x-partq-partition"
HEADER_MEMBER = "x-partq-member"
HEADER_FAILED_MS = "x-partq-failed-ms"
# What a redrive removes before publishing a dead letter into its partition again: the
# consumer's bookkeeping above and the broker's (dead-lettering, quorum redeliveries).
DEAD_LETTER_HEADERS = (
    HEADER_ERROR, HEADER_ERROR_TYPE, HEADER_ATTEMPTS, HEADER_FAILED_PARTITION, HEADER_MEMBER,
    HEADER_FAILED_MS, "x-death", "x-first-death-exchange", "x-first-death-queue",
    "x-first-death-reason", "x-last-death-exchange", "x-last-death-queue",
    "x-last-death-reason", "x-delivery-count",
)  # fmt: skip
# Who may send one: the AMQP users of these roles of the stream (see :func:`role_name`) and,
# for a deployment with one shared user, the consumer's own user. RabbitMQ checks a
# message's ``user_id`` property against the user that published it, so it cannot be forged.
CONTROL_ROLES = ("operator", "admin")

# Quorum partition queues carry an explicit delivery limit, far above partq's own retries
# (which count handler attempts in the consumer, not broker deliveries), and dead-letter to
# the stream's DLQ when it is reached. Two reasons (docs/architecture.md, "Returns"):
# with a limit, RabbitMQ 3.x puts a returned delivery at the *head* of the queue (without
# one, at the back: a reorder); and RabbitMQ 4.0+ defaults the limit to 20 and then
# *drops* the message unless it is dead-lettered. Never -1 (unlimited): that brings the
# back-of-queue return back.
QUORUM_DELIVERY_LIMIT = 1000


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition of ``key``: murmur3_x86_32(key bytes, seed 0), unsigned, mod ``partitions``.

    ``str`` keys are hashed as UTF-8; ``bytes`` as they are. Any other type is a
    ``TypeError`` (convert numbers to ``str`` yourself, so every language agrees).
    """
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, bytes | bytearray | memoryview):
        data = bytes(key)
    else:
        raise TypeError(f"partition key must be str or bytes, not {type(key).__name__}")
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"partitions must be an int, not {type(partitions).__name__}")
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    return int(mmh3.hash(data, 0, signed=False)) % partitions


def validate_group_name(name: str) -> str:
    """Return ``name`` if it is a valid consumer group name (the same rule as a stream's,
    and no reserved ending), else raise :class:`InvalidStreamName`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > _NAME_MAX:
        raise InvalidStreamName(
            f"invalid group name {name!r}: use lower-case letters, digits, '_', '.' and '-', "
            f"starting with a letter or digit, at most {_NAME_MAX} characters"
        )
    if _RESERVED_SUFFIX.search(name):
        raise InvalidStreamName(
            f"group name {name!r} ends like one of partq's queue names: pick a name that "
            f"does not end in .pNNNNN, .dlq, .dlx, .park or .park.<16 hex>"
        )
    return name


def group_scope(stream: str, group: str = DEFAULT_GROUP) -> str:
    """What names one group of ``stream`` in etcd keys, queue names and roles: the stream's
    name for its default group (the names a stream had before groups), ``STREAM~GROUP``
    for any other ("~" is in no stream's or group's name, so no two scopes meet)."""
    validate_stream_name(stream)
    validate_group_name(group)
    return stream if group == DEFAULT_GROUP else f"{stream}{GROUP_SEPARATOR}{group}"


def split_scope(scope: str) -> tuple[str, str]:
    """The stream and group a :func:`group_scope` names; :class:`InvalidStreamName` if it
    names none."""
    if not isinstance(scope, str):
        raise InvalidStreamName(f"invalid stream name {scope!r}: not a string")
    stream, separator, group = scope.partition(GROUP_SEPARATOR)
    validate_stream_name(stream)
    if separator:
        if validate_group_name(group) == DEFAULT_GROUP:
            raise InvalidStreamName(f"{scope!r}: the default group is named by its stream alone")
        return stream, group
    return stream, DEFAULT_GROUP


def validate_stream_name(name: str) -> str:
    """Return ``name`` if it is a valid stream name, else raise :class:`InvalidStreamName`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > _NAME_MAX:
        raise InvalidStreamName(
            f"invalid stream name {name!r}: use lower-case letters, digits, '_', '.' and '-', "
            f"starting with a letter or digit, at most {_NAME_MAX} characters "
            f"(pattern [a-z0-9][a-z0-9_.-]*)"
        )
    return name


# What partq appends to a stream's name for its queues and exchanges: a stream whose name
# ends like this would be named as another stream's queue, and the rights of one would
# reach the other's (RabbitMQ permissions are regular expressions over names).
_PARTITION_SUFFIX = r"p\d{5}"  # queue_name's ending
_PARK_SUFFIX = r"park\.[0-9a-f]{16}"  # park_queue's
_RESERVED_SUFFIX = re.compile(rf"\.(?:{_PARTITION_SUFFIX}|dlq|dlx|park|{_PARK_SUFFIX})$")


def check_partition_count(partitions: object) -> int:
    """``partitions`` if it is a whole number in ``1..MAX_PARTITIONS``, else :class:`UsageError`."""
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise UsageError(f"partitions must be a whole number, got {partitions!r}")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise UsageError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {partitions}")
    return partitions


def refuse_overlap(name: str) -> str:
    """Return ``name`` if no other stream's queue or exchange is named like it, else raise
    :class:`InvalidStreamName` naming the conflict (for a stream about to be created)."""
    validate_stream_name(name)
    found = _RESERVED_SUFFIX.search(name)
    if found is None:
        return name
    other, suffix = name[: found.start()], found.group()[1:]
    kind = {"dlq": "dead-letter queue", "dlx": "dead-letter exchange"}.get(suffix)
    kind = kind or ("parking exchange" if suffix == "park" else None)
    kind = kind or ("parking queue" if suffix.startswith("park.") else "partition queue")
    raise InvalidStreamName(
        f"stream name {name!r} overlaps stream {other!r}: {_PREFIX}.{name} is the name of "
        f"its {kind}; pick a name that does not end in .pNNNNN, .dlq, .dlx, .park or "
        f".park.<16 hex>"
    )


def role_name(stream: str, component: str, member: str | None = None) -> str:
    """The etcd role and RabbitMQ user of one component of ``stream`` (``partq security
    roles``): ``partq-S-COMPONENT``, or ``partq-S-consumer-ID`` for a named member."""
    return f"partq-{stream}-{component}" + (f"-{member}" if member is not None else "")


def refuse_control_headers(headers: Mapping[str, Any] | None) -> None:
    """Producers may not send partq's control header (only ``partq dlq`` sends it)."""
    if headers and HEADER_GROUP in headers:
        raise UsageError(
            f"header {HEADER_GROUP!r} is partq's own (it addresses one consumer group when "
            f"`partq dlq` redrives): drop the header"
        )
    if headers and HEADER_CONTROL in headers:
        raise UsageError(
            f"header {HEADER_CONTROL!r} is partq's own (a dlq redrive or purge request): "
            f"use `partq dlq redrive|purge` as the stream's operator, or drop the header"
        )


def exchange_name(scope: str) -> str:
    """The stream's exchange: every group's queues are bound to it (one publish reaches each)."""
    return f"{_PREFIX}.{keys.stream_of(scope)}"


def queue_name(stream: str, partition: int) -> str:
    """The queue of one partition, e.g. ``partq.orders.p00007``; see :func:`queue_pattern`."""
    if not 0 <= partition < MAX_PARTITIONS:
        raise ValueError(f"partition {partition} is outside 0..{MAX_PARTITIONS - 1}")
    return f"{_PREFIX}.{stream}.p{partition:05d}"


def partition_exchange(stream: str, partition: int) -> str:
    """The fanout exchange of one partition of a stream that has groups, e.g.
    ``partq.orders~p00007``: the stream's exchange routes the partition's routing keys to
    it, and every group's queue of the partition is bound to it, so one binding carries a
    partition to every group and a resize's cut of it is one step for all (docs/groups.md).
    ("~" is in no stream's name, and no group's names end without a suffix.)"""
    return f"{_PREFIX}.{keys.stream_of(stream)}{GROUP_SEPARATOR}p{partition:05d}"


def queue_pattern(stream: str) -> str:
    """A regex that matches exactly the partition queues of ``stream``."""
    return rf"^{re.escape(_PREFIX)}\.{re.escape(stream)}\.{_PARTITION_SUFFIX}$"


def park_queue_pattern(stream: str) -> str:
    """A regex that matches exactly the parking queues of ``stream`` (see :func:`park_queue`)."""
    return rf"^{re.escape(_PREFIX)}\.{re.escape(stream)}\.{_PARK_SUFFIX}$"


def dead_letter_queue(stream: str) -> str:
    return f"{_PREFIX}.{stream}.dlq"


def key_bytes(key: str | bytes) -> bytes:
    """A key as the bytes it is hashed as (a ``str`` key is its UTF-8)."""
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


# A key up to this many bytes is named by its unpadded base64url (at most 2,048 characters,
# readable as it is); a longer one (the producer takes keys of ~128 KiB, as large as an AMQP
# header frame allows) by ``sha256.<hex digest>``: "." is not base64url, so the two never
# meet, and the full key is kept in the parked record.
PLAIN_KEY_ID_BYTES = 1536
_LONG_KEY_ID = "sha256."


def key_id(key: str | bytes) -> str:
    """A key as one etcd key segment: unpadded URL-safe base64 of its bytes, or for a key
    longer than :data:`PLAIN_KEY_ID_BYTES` ``sha256.`` and the hex digest of its bytes."""
    data = key_bytes(key)
    if len(data) > PLAIN_KEY_ID_BYTES:
        return _LONG_KEY_ID + hashlib.sha256(data).hexdigest()
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def long_key_id(name: str) -> bool:
    """Whether ``name`` is a long key's id (a digest: the key is not in it)."""
    return name.startswith(_LONG_KEY_ID)


def key_from_id(name: str) -> bytes:
    """The key bytes of a :func:`key_id`; ``ValueError`` for a long key's (a digest)."""
    if long_key_id(name):
        raise ValueError(f"{name} names a long key by its digest: the key is in its record")
    return base64.urlsafe_b64decode(name + "=" * (-len(name) % 4))


def park_queue(stream: str, key: str | bytes) -> str:
    """The parking queue of one key, e.g. ``partq.orders.park.3f0c9a1b2d4e5f60``."""
    digest = hashlib.sha256(key_bytes(key)).hexdigest()[:16]
    return f"{_PREFIX}.{stream}.park.{digest}"


def park_exchange(stream: str) -> str:
    """The exchange consumers park messages through (each parking queue bound to it under
    its own name).

    Not the dead-letter exchange: binding to an exchange needs *read* on it, and a consumer
    that could bind to the dead-letter exchange could bind a queue of its own under the
    DLQ's routing key and be copied every dead letter (docs/security.md).
    """
    return f"{_PREFIX}.{stream}.park"


def dead_letter_exchange(stream: str) -> str:
    """The exchange consumers publish dead letters to (bound to the dead-letter queue).

    Its own exchange, so a consumer needs write access to it alone: write access to the
    default exchange would let it publish into any queue of the vhost.
    """
    return f"{_PREFIX}.{stream}.dlx"


def encode_key(key: str | bytes) -> dict[str, str]:
    """Headers that carry ``key`` so that :func:`decode_key` gives back the same type."""
    if isinstance(key, str):
        return {HEADER_KEY: key}
    return {HEADER_KEY_B64: base64.b64encode(bytes(key)).decode("ascii")}


def fence_routing_key(epoch: int, partition: int) -> str:
    """The routing key of the fence that ends ``epoch`` in ``partition``'s queue."""
    return f"fence.{epoch}.{partition}"


def decode_key(headers: Mapping[str, Any]) -> str | bytes | None:
    if HEADER_KEY in headers:
        value = headers[HEADER_KEY]
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    if HEADER_KEY_B64 in headers:
        return base64.b64decode(headers[HEADER_KEY_B64])
    return None


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """A stream: its name, its fixed number of partitions and its queue type."""

    name: str
    partitions: int
    queue_type: QueueType = "quorum"
    version: int = 1
    # "dead-letter" where a stored spec lacks the field; `partq stream create` parks
    on_failure: OnFailure = "dead-letter"
    # quorum queues: members of each queue's Raft group (x-quorum-initial-group-size);
    # None: the broker's default (no argument)
    replicas: int | None = None
    # the layout's epoch: 0 as created; each resize makes the next (docs/resize.md). A spec
    # with an epoch is version 2, so an older partq refuses it ("upgrade") instead of
    # publishing under a stale layout; an epoch-0 spec stays version 1, byte for byte.
    epoch: int = 0
    # the consumer group whose queues the naming methods name (not stored: a spec is the
    # stream's, and every group reads the same one; :meth:`in_group`)
    group: str = DEFAULT_GROUP

    def __post_init__(self) -> None:
        validate_stream_name(self.name)
        validate_group_name(self.group)
        check_partition_count(self.partitions)
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise UsageError(f"a stream's epoch is a whole number >= 0, got {self.epoch!r}")
        if self.epoch and self.version == 1:  # the default: a spec with an epoch is v2
            object.__setattr__(self, "version", 2)
        if self.version != (2 if self.epoch else 1):
            raise UsageError(
                f"a stream spec of epoch {self.epoch} is version {2 if self.epoch else 1}, "
                f"not {self.version}"
            )
        if self.queue_type not in QUEUE_TYPES:
            raise UsageError(
                f"queue type must be one of {', '.join(QUEUE_TYPES)}, got {self.queue_type!r}"
            )
        if self.replicas is not None:
            if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
                raise UsageError(f"replicas must be a whole number, got {self.replicas!r}")
            if self.replicas < 1:
                raise UsageError(f"replicas must be at least 1, got {self.replicas}")
            if self.queue_type != "quorum":
                raise UsageError(
                    "replicas apply to quorum queues only (classic queues are not replicated "
                    "since RabbitMQ 4.0): drop --replicas or use --queue-type quorum"
                )
        if self.on_failure not in ON_FAILURE:
            raise UsageError(
                f"on-failure must be one of {', '.join(ON_FAILURE)}, got {self.on_failure!r}"
            )

    def partition_for(self, key: str | bytes) -> int:
        return partition_for(key, self.partitions)

    @property
    def layout(self) -> Layout:
        """This spec's partition count under its epoch (``partq.producer.layout``)."""
        from partq.producer.layout import Layout  # layout imports this module

        return Layout(self.partitions, self.epoch)

    @property
    def scope(self) -> str:
        """The group's name in etcd keys, queue names and roles (:func:`group_scope`)."""
        return group_scope(self.name, self.group)

    def in_group(self, group: str) -> StreamSpec:
        """This spec naming ``group``'s queues."""
        return self if group == self.group else dataclasses.replace(self, group=group)

    def queue(self, partition: int) -> str:
        if not 0 <= partition < self.partitions:
            raise ValueError(
                f"partition {partition} is outside 0..{self.partitions - 1} of {self.name!r}"
            )
        return queue_name(self.scope, partition)

    @property
    def exchange(self) -> str:
        return exchange_name(self.name)

    @property
    def dead_letter_queue(self) -> str:
        return dead_letter_queue(self.scope)

    @property
    def dead_letter_exchange(self) -> str:
        return dead_letter_exchange(self.scope)

    def park_queue(self, key: str | bytes) -> str:
        return park_queue(self.scope, key)

    @property
    def park_exchange(self) -> str:
        return park_exchange(self.scope)

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "v": self.version,
            "name": self.name,
            "partitions": self.partitions,
            "queue_type": self.queue_type,
        }
        if self.on_failure != "dead-letter":  # an older spec reads back unchanged
            doc["on_failure"] = self.on_failure
        if self.replicas is not None:
            doc["replicas"] = self.replicas
        if self.epoch:
            doc["epoch"] = self.epoch
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, key: str = "") -> StreamSpec:
        """The spec in ``raw``; :class:`MalformedValue` naming ``key`` if it is not one."""
        where = f" at {key}" if key else ""
        try:
            doc = json.loads(raw)
        except ValueError as e:  # not UTF-8, or not JSON
            raise MalformedValue(f"malformed stream spec{where}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise MalformedValue(f"malformed stream spec{where}: not a JSON object")
        version = doc.get("v")
        if type(version) is not int or version not in (1, 2):
            raise UsageError(
                f"stream spec{where} version {version!r} is not understood by this partq: "
                f"upgrade it"
            )
        try:
            return cls(
                name=doc["name"],
                partitions=doc["partitions"],
                queue_type=doc["queue_type"],
                version=version,
                on_failure=doc.get("on_failure", "dead-letter"),
                replicas=doc.get("replicas"),
                epoch=doc.get("epoch", 0) if version == 2 else 0,
            )
        except KeyError as e:
            raise MalformedValue(f"malformed stream spec{where}: no {e.args[0]!r}") from None
        except UsageError as e:
            raise MalformedValue(f"malformed stream spec{where}: {e}") from None

    def check_partitions(self, configured: int | None) -> None:
        """Refuse to run when a configured partition count disagrees with this spec."""
        if configured is not None and configured != self.partitions:
            raise SpecMismatch(
                f"stream {self.name!r} has {self.partitions} partitions in etcd, but "
                f"{configured} were configured here: fix the configuration "
                f"(partitions are fixed when a stream is created)"
            )


def is_seal(text: str) -> bool:
    """Whether ``text`` is a seal as ``partq stream resize`` makes them (32 hex digits)."""
    return _SEAL.fullmatch(text) is not None


def seal_digest(seal: str) -> str:
    """What etcd keeps of a fence's seal (:data:`HEADER_SEAL`): its SHA-256, in hex."""
    return hashlib.sha256(seal.encode("utf-8", errors="replace")).hexdigest()
