"""Every value partq stores in etcd: encoded with :func:`json.dumps`, decoded with checks.

:mod:`partq.kernel.keys` names the keys and :data:`partq.coordinator.store.kinds.KINDS` says which
decoder of this module reads each kind; this module is the only one that writes or
reads their values, and parses a request key's name (:func:`parse_request_name`) and a
drained key's (:func:`parse_drained_name`).
Encoders refuse what decoders would refuse, so partq never
writes a value it cannot read back; decoders check the JSON, the version ``v``, the
type of every field and the key's own name, and raise
:class:`~partq.kernel.errors.MalformedValue` with the reason, never a ``KeyError`` or
``JSONDecodeError`` from deep inside a daemon. :class:`partq.coordinator.store.group.Group`
decodes every value it reads once, here, and treats a malformed one as absent.

====================================  ===============================================  ==========
key under ``/partq/v1/streams/<s>/``  value (JSON object, keys sorted)                 decoded as
====================================  ===============================================  ==========
``members/<member id>``               ``{"v": 1, "id", "weight" (1-1000), "host", "pid", Member
                                      "version", "started"}`` (+ ``"leaving": true``
                                      once it announced its stop), on its lease
``assignment/<partition:05d>``        ``{"v": 1, "owner": <member id>}``               Assignment
``claims/<partition:05d>``            ``{"v": 1, "member": <member id>, "at"}``,       Claim
                                      on the claimer's lease (+ ``"takeover": true,
                                      "from": <member id>`` when a standby took it
                                      from a dead owner; ``"priority"``,
                                      ``"sealed": true``, ``"live": true``: see Claim)
``standby/<partition:05d>``           ``{"v": 1, "member": <member id>}``              Standby
``leader/<lease id:016x>``            empty, on the candidate's lease                  Candidate
``requests/rebalance``                ``{"v": 1, "at"}``                               Rebalance
``requests/move-<partition>``         ``{"v": 1, "partition", "to": <member id>,       Move
                                      "at"}``
``requests/drain-<member id>``        ``{"v": 1, "member": <member id>, "at"}``        Drain
``requests/pause``                    ``{"v": 1, "at"}`` (every partition)              Pause
``requests/pause-<partition>``        ``{"v": 1, "partition", "at"}``                  Pause
``parked/<key id>``                    ``{"v": 1, "partition", "error", "error_type",   Parked
                                      "message_id", "member", "at"}`` (+ ``"redrive",
                                      "redrive_error"`` once a replay failed): a key
                                      parked (``on_failure = park``); id: unpadded
                                      base64url, or ``sha256.<hex>`` for a key over
                                      1,536 bytes, whose value then holds ``"key"``
                                      (base64)
``drained/<epoch>/<partition:05d>``   ``{"v": 1, "member", "seal"}``: old             Drained
                                      ``partition``'s consumer handled the fence of
                                      resize epoch ``epoch``, whose seal it carries
                                      (not on a lease)
``spec``                              :meth:`StreamSpec.to_json`                       StreamSpec
``resize``                            ``{"v": 1, "old", "new": {"epoch",                resize.State
                                      "partitions"}, "phase", "fenced", "drained",
                                      "deleted", "not_empty"}``
                                      (:func:`partq.coordinator.leader.resize.encode`, written by
                                      ``partq stream resize``)
====================================  ===============================================  ==========

Outside the stream's keys, ``/partq/v1/load/<s>/<member id>``: ``{"v": 1, "member",
"at", "interval", "rates": {"<partition>": messages handled per second}}`` (+
``"parking_stalled": [<partition>, …]`` while a message cannot be parked), on the
member's lease, decoded as LoadReport (:func:`encode_load`, :func:`decode_load`). And
``/partq/v1/policy/<s>/<lease id:016x>``: ``{"v": 1, "policy": {setting: plain value}}``,
a coordinator's settings on its candidate's lease (:func:`encode_policy`,
:func:`decode_policy`).

``at`` and ``started`` are Unix times (seconds, a finite JSON number); other fields
partq does not know are ignored (a later 1.x may add some), a missing one is an error.

**Member ids** match :data:`MEMBER_ID_PATTERN`: an ASCII letter or digit, then up to
252 letters, digits, ``_ . : @ -`` (253 in all, the longest DNS name). That admits
host names, Kubernetes pod names and the default ``<host>-<pid>-<hex>``; it refuses
quotes, backslashes, slashes (an id is one etcd key segment), whitespace and control
characters. :func:`validate_member_id` checks it where an id comes in (joining, the
``move``/``drain`` commands) and every decoder checks it again.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from partq.coordinator.leader import resize
from partq.coordinator.leader.resize import State as ResizeState
from partq.producer.contract import (
    MAX_PARTITIONS,
    StreamSpec,
    is_seal,
    key_from_id,
    key_id,
    long_key_id,
    split_scope,
)

from partq.kernel.errors import InvalidMemberId, MalformedValue, UsageError

__all__ = [
    "MAX_NUMBER",
    "MAX_RATE",
    "MAX_WEIGHT",
    "MEMBER_ID_PATTERN",
    "VERSION",
    "Assignment",
    "Candidate",
    "Claim",
    "Concurrency",
    "Drain",
    "Drained",
    "LoadReport",
    "Member",
    "Move",
    "Parked",
    "Pause",
    "Policy",
    "Rebalance",
    "Request",
    "Standby",
    "Value",
    "candidate_name",
    "decode_assignment",
    "decode_candidate",
    "decode_claim",
    "decode_drained",
    "decode_load",
    "decode_member",
    "decode_parked",
    "decode_policy",
    "decode_request",
    "decode_resize",
    "decode_spec",
    "decode_standby",
    "drained_name",
    "encode_assignment",
    "encode_candidate",
    "encode_claim",
    "encode_drained",
    "encode_load",
    "encode_member",
    "encode_parked",
    "encode_policy",
    "encode_request",
    "encode_standby",
    "member_name",
    "parked_name",
    "parse_drained_name",
    "parse_request_name",
    "partition_name",
    "request_name",
    "spec_name",
    "validate_member_id",
]

VERSION: Final = 1
MEMBER_ID_PATTERN: Final = r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,252}"
_MEMBER_ID = re.compile(MEMBER_ID_PATTERN)
_PARTITION = re.compile(r"[0-9]{5}")
_LEASE = re.compile(r"[0-9a-f]{16}")
MAX_WEIGHT: Final = 1000  # a member's weight: its share of the partitions
MAX_PRIORITY: Final = 2**31 - 1  # a claim's consumer priority (RabbitMQ's x-priority)
# unpadded base64url of a message key, or a long key's digest (partq.producer.contract.key_id)
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,2048}|sha256\.[0-9a-f]{64}")

# -- the values ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """A consumer in the group; ``lease`` is the member key's lease (not in the value)."""

    id: str
    weight: int = 1
    lease: int = 0
    host: str = ""
    pid: int = 0
    version: str = ""
    started: float = 0.0
    leaving: bool = False  # announced its stop: it hands its partitions over, then leaves
    priority: bool = (
        False  # hands partitions over by consumer priority (partq.consumers.state.priority)
    )


@dataclass(frozen=True, slots=True)
class Assignment:
    """The leader's choice of owner for one partition."""

    owner: str


@dataclass(frozen=True, slots=True)
class Claim:
    """A member consuming a partition; ``lease`` is the claim key's lease (not in the value)."""

    member: str
    lease: int
    at: float = 0.0
    takeover: bool = False  # a hot standby took the partition over from its dead owner
    taken_from: str = ""  # ... that owner (suspect until the claim is made ordinary)
    priority: int = 0  # the x-priority its holder consumes with (partq.consumers.state.priority)
    sealed: bool = False  # its holder may cancel: no heir may take it over by priority
    # its holder's consumer is subscribed (consume-ok): a hot standby may stand behind it
    live: bool = False


@dataclass(frozen=True, slots=True)
class Standby:
    """The leader's choice of hot standby for one partition (``coordinator --standby``)."""

    member: str


@dataclass(frozen=True, slots=True)
class Candidate:
    """A coordinator standing for leader of the stream (the lowest create revision leads)."""

    lease: int


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Operator request: rebalance now (``partq rebalance``)."""

    at: float = 0.0

    @property
    def name(self) -> str:
        return "rebalance"


@dataclass(frozen=True, slots=True)
class Move:
    """Operator request: give ``partition`` to member ``to`` (``partq move``)."""

    partition: int
    to: str
    at: float = 0.0

    @property
    def name(self) -> str:
        return f"move-{self.partition}"


@dataclass(frozen=True, slots=True)
class Drain:
    """Operator request: move every partition away from ``member`` (``partq drain``)."""

    member: str
    at: float = 0.0

    @property
    def name(self) -> str:
        return f"drain-{self.member}"


@dataclass(frozen=True, slots=True)
class Pause:
    """Operator request: the owner of ``partition`` (None: of every partition) stops
    consuming it and keeps it (``partq pause``); deleting the request resumes it."""

    partition: int | None = None
    at: float = 0.0

    @property
    def name(self) -> str:
        return "pause" if self.partition is None else f"pause-{self.partition}"


MAX_SHOWN_KEY: Final = 200  # characters of a waiting key in a load report
# Messages per second a load report may give one partition, at most: far above what one
# queue serves, and small enough that the sum over every partition stays a finite float.
MAX_RATE: Final = 1e9
# Any other number decoded (Unix times, intervals, seconds), in absolute value at most.
MAX_NUMBER: Final = 1e15


@dataclass(frozen=True, slots=True)
class Concurrency:
    """A member's ``--concurrency`` and what its handlers held when it reported: messages in
    a handler per owned partition, and the key whose message had waited longest behind an
    earlier one of that key (``waiting_key``, as shown in logs; None: none waited)."""

    setting: int
    in_flight: Mapping[int, int]
    waiting_key: str | None = None
    waiting_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a member handled per partition over its last ``interval`` seconds (messages per
    second), reported at ``at`` for the lag-aware assignment and the status page."""

    member: str
    rates: Mapping[int, float]
    at: float = 0.0
    interval: float = 0.0
    # partitions waiting because a message cannot be parked now
    # (partq.consumers.handling.parking.ParkStalls)
    parking_stalled: tuple[int, ...] = ()
    # messages in a handler when reported (None: written by an older partq)
    in_flight: int | None = None
    concurrency: Concurrency | None = None  # None: written by an older partq

    @property
    def total(self) -> float:
        return sum(self.rates.values())

    def fresh(self, now: float) -> bool:
        """Whether it is recent enough to count at Unix time ``now``: made within three
        report intervals (at least 3 s); an older one is a member that stopped reporting."""
        return now - self.at <= 3 * max(self.interval, 1.0)


@dataclass(frozen=True, slots=True)
class Parked:
    """A message key parked by the owner of its partition: its messages wait, in order, in
    the key's parking queue until ``partq dlq redrive`` (or ``purge``)."""

    key_id: str  # the key's name (partq.kernel.keys.parked): partq.producer.contract.key_id
    partition: int
    error: str  # the handler's error that parked it (truncated)
    error_type: str
    message_id: str  # the message that failed
    member: str  # who parked it
    at: float = 0.0
    # the last `partq dlq redrive` whose replay failed (its request's message id), and why:
    # the command waiting for that request returns with the error instead of timing out
    redrive: str = ""
    redrive_error: str = ""
    long_key: bytes = b""  # the key, when key_id is a long key's digest (not otherwise)

    @property
    def key(self) -> bytes:
        return self.long_key if long_key_id(self.key_id) else key_from_id(self.key_id)

    @property
    def key_text(self) -> str:
        """The key for people: its UTF-8 text, or ``b64:<base64>`` when it is not text."""
        try:
            return self.key.decode("utf-8")
        except UnicodeDecodeError:
            return "b64:" + base64.b64encode(self.key).decode("ascii")

    @property
    def key_shown(self) -> str:
        """:attr:`key_text` for an overview: a long key cut short, with its length."""
        text = self.key_text
        return text if len(text) <= 100 else f"{text[:100]}... ({len(self.key)} bytes)"


Request = Rebalance | Move | Drain | Pause


@dataclass(frozen=True, slots=True)
class Drained:
    """An old partition's consumer handled the fence of a resize (``drained/<epoch>/<p>``):
    every old-layout message of that partition is handled. Not on a lease: it stays true."""

    epoch: int
    partition: int
    member: str  # who handled the fence
    seal: str = ""  # the fence's HEADER_SEAL (none from a partq that sealed no fence)


Value = (
    Member
    | Assignment
    | Claim
    | Standby
    | Candidate
    | Request
    | Parked
    | Drained
    | StreamSpec
    | ResizeState
)


# -- member ids ------------------------------------------------------------------------------


def validate_member_id(member_id: object) -> str:
    """``member_id`` if it is a valid member id, else :class:`InvalidMemberId` (a usage error)."""
    if not isinstance(member_id, str) or not _MEMBER_ID.fullmatch(member_id):
        raise InvalidMemberId(
            f"invalid member id {member_id!r}: use ASCII letters, digits, '_', '.', ':', '@' "
            f"and '-', starting with a letter or digit, at most 253 characters "
            f"(pattern {MEMBER_ID_PATTERN})"
        )
    return member_id


# -- encoding ----------------------------------------------------------------------------------


Policy = bool | int | float | str | None


def _plain(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _dumps(**fields: Any) -> str:
    return json.dumps({"v": VERSION, **fields}, sort_keys=True, allow_nan=False)


def _time(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, got {value!r}")
    return float(value)


def _count(value: int, what: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be a whole number of at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{what} must be at most {maximum}, got {value!r}")
    return value


def _text(value: str, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {value!r}")
    return value


def encode_member(member: Member) -> str:
    """A member key's value (``member.lease`` is the key's lease, not part of it)."""
    return _dumps(
        id=validate_member_id(member.id),
        weight=_count(member.weight, "weight", 1, MAX_WEIGHT),
        host=_text(member.host, "host"),
        pid=_count(member.pid, "pid", 0),
        version=_text(member.version, "version"),
        started=_time(member.started, "started"),
        **({"leaving": True} if member.leaving else {}),
        **({"priority": True} if member.priority else {}),
    )


def encode_assignment(owner: str) -> str:
    return _dumps(owner=validate_member_id(owner))


def encode_candidate() -> str:
    """A leader candidate key's value: empty (the key's name and lease are what count)."""
    return ""


def encode_claim(
    member: str,
    at: float,
    *,
    taken_from: str = "",
    priority: int = 0,
    sealed: bool = False,
    live: bool = False,
) -> str:
    """A claim; ``taken_from``: the dead owner a hot standby took the partition from;
    ``priority``: the holder's x-priority (0: none written); ``sealed``, ``live``: see
    :class:`Claim`."""
    extra: dict[str, Any] = (
        {"takeover": True, "from": validate_member_id(taken_from)} if taken_from else {}
    )
    if priority:
        extra["priority"] = _count(
            priority, "priority", 0
        )  # below 2**31 (partq.consumers.state.priority)
    if sealed:
        extra["sealed"] = True
    if live:
        extra["live"] = True
    return _dumps(member=validate_member_id(member), at=_time(at, "at"), **extra)


def encode_standby(member: str) -> str:
    return _dumps(member=validate_member_id(member))


def encode_drained(member: str, seal: str) -> str:
    """``seal``: the fence's; "" for a fence that carried none (an older partq's resize)."""
    if not seal:
        return _dumps(member=validate_member_id(member))
    return _dumps(member=validate_member_id(member), seal=_seal(seal))


def encode_parked(parked: Parked) -> str:
    _key_id(parked.key_id)
    long = {}
    if long_key_id(parked.key_id):
        if key_id(parked.long_key) != parked.key_id:
            raise ValueError(f"the long key of {parked.key_id} is not the key it names")
        long = {"key": base64.b64encode(parked.long_key).decode("ascii")}
    return _dumps(
        **long,
        partition=_count(parked.partition, "partition", 0),
        error=_text(parked.error, "error")[:2000],
        error_type=_text(parked.error_type, "error_type")[:200],
        message_id=_text(parked.message_id, "message_id")[:256],
        member=validate_member_id(parked.member),
        at=_time(parked.at, "at"),
        **(
            {
                "redrive": _text(parked.redrive, "redrive")[:256],
                "redrive_error": _text(parked.redrive_error, "redrive_error")[:2000],
            }
            if parked.redrive
            else {}
        ),
    )


def encode_load(report: LoadReport) -> str:
    rates = {}
    for partition, rate in sorted(report.rates.items()):
        if _count(partition, "partition", 0) >= MAX_PARTITIONS:
            raise ValueError(f"partition must be below {MAX_PARTITIONS}, got {partition}")
        if _time(rate, "rate") < 0:
            raise ValueError(f"a rate must not be negative, got {rate!r}")
        rates[str(partition)] = round(float(rate), 3)
    stalled = sorted(_count(p, "partition", 0) for p in report.parking_stalled)
    return _dumps(
        member=validate_member_id(report.member),
        at=_time(report.at, "at"),
        interval=_time(report.interval, "interval"),
        rates=rates,
        **({"parking_stalled": stalled} if stalled else {}),
        **(
            {}
            if report.in_flight is None
            else {"in_flight": _count(report.in_flight, "in_flight", 0)}
        ),
        **({} if report.concurrency is None else {"concurrency": _concurrency(report.concurrency)}),
    )


def _concurrency(c: Concurrency) -> dict[str, Any]:
    in_flight = {}
    for partition, count in sorted(c.in_flight.items()):
        if _count(partition, "partition", 0) >= MAX_PARTITIONS:
            raise ValueError(f"partition must be below {MAX_PARTITIONS}, got {partition}")
        in_flight[str(partition)] = _count(count, "in_flight", 0)
    doc: dict[str, Any] = {"setting": _count(c.setting, "concurrency", 1), "in_flight": in_flight}
    if c.waiting_key is not None:
        if len(_text(c.waiting_key, "waiting_key")) > MAX_SHOWN_KEY:
            raise ValueError(f"waiting_key must be at most {MAX_SHOWN_KEY} characters")
        doc["waiting"] = {"key": c.waiting_key, "seconds": _time(c.waiting_seconds, "seconds")}
    return doc


def _decode_concurrency(doc: Any) -> Concurrency:
    """A load report's ``concurrency`` object; :class:`MalformedValue` if partq did not
    write it."""
    if not isinstance(doc, dict):
        raise MalformedValue(f"'concurrency' is not an object: {doc!r}")
    setting = _int(doc, "setting", 1)
    found = _field(doc, "in_flight")
    if not isinstance(found, dict) or not all(
        name.isascii() and name.isdigit() and int(name) < MAX_PARTITIONS
        and type(count) is int and count >= 0
        for name, count in found.items()
    ):  # fmt: skip
        raise MalformedValue(f"'in_flight' is not counts by partition: {found!r}")
    waiting = doc.get("waiting")
    if waiting is None:
        return Concurrency(setting, {int(n): c for n, c in found.items()})
    if not isinstance(waiting, dict):
        raise MalformedValue(f"'waiting' is not an object: {waiting!r}")
    key = _str(waiting, "key")
    seconds = _number(waiting, "seconds")
    if len(key) > MAX_SHOWN_KEY or seconds < 0:
        raise MalformedValue(f"'waiting' is not a key and its seconds: {waiting!r}")
    return Concurrency(setting, {int(n): c for n, c in found.items()}, key, seconds)


def encode_policy(policy: Mapping[str, Policy]) -> str:
    """A coordinator's policy: its settings by name (numbers, booleans, text, null)."""
    for name, value in policy.items():
        if not _plain(value):
            raise ValueError(f"policy setting {name} is not a plain value: {value!r}")
    return _dumps(policy=dict(sorted(policy.items())))


def decode_policy(raw: bytes | str) -> dict[str, Policy]:
    """A coordinator's policy; :class:`MalformedValue` if partq did not write it."""
    found = _field(_object(raw), "policy")
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and _plain(v) for k, v in found.items()
    ):
        raise MalformedValue(f"'policy' is not an object of plain values: {found!r}")
    return dict(found)


def decode_load(member_id: str, raw: bytes | str) -> LoadReport:
    """The load report under ``member_id``'s key; :class:`MalformedValue` if partq did not
    write it."""
    _name_id(member_id)
    doc = _object(raw)
    if _id(doc, "member") != member_id:
        raise MalformedValue(f"'member' {doc['member']!r} is not the key's {member_id!r}")
    found = _field(doc, "rates")
    if not isinstance(found, dict):
        raise MalformedValue(f"'rates' is not an object: {found!r}")
    rates: dict[int, float] = {}
    for name, rate in found.items():
        if not (name.isascii() and name.isdigit()) or int(name) >= MAX_PARTITIONS:
            raise MalformedValue(f"'rates' names no partition: {name!r}")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 0:
            raise MalformedValue(f"the rate of partition {name} is not a number >= 0: {rate!r}")
        if rate > MAX_RATE:
            raise MalformedValue(
                f"the rate of partition {name} is not at most {MAX_RATE:g}: {_shown(rate)}"
            )
        rates[int(name)] = float(rate)
    stalled = doc.get("parking_stalled", [])  # absent: none stalled
    if not isinstance(stalled, list) or not all(
        type(p) is int and 0 <= p < MAX_PARTITIONS for p in stalled
    ):
        raise MalformedValue(f"'parking_stalled' is not a list of partitions: {stalled!r}")
    in_flight = doc.get("in_flight")  # absent: written by an older partq
    if in_flight is not None and (type(in_flight) is not int or in_flight < 0):
        raise MalformedValue(f"'in_flight' is not a count: {in_flight!r}")
    return LoadReport(
        member_id,
        rates,
        _number(doc, "at"),
        _number(doc, "interval"),
        tuple(sorted(stalled)),
        in_flight,
        None if doc.get("concurrency") is None else _decode_concurrency(doc["concurrency"]),
    )


def encode_request(request: Request) -> tuple[str, str]:
    """(the request key's name, its value)."""
    at = _time(request.at, "at")
    if isinstance(request, Rebalance):
        return request.name, _dumps(at=at)
    if isinstance(request, Move):
        partition = _count(request.partition, "partition", 0)
        if partition >= MAX_PARTITIONS:
            raise ValueError(f"partition must be below {MAX_PARTITIONS}, got {partition}")
        return request.name, _dumps(partition=partition, to=validate_member_id(request.to), at=at)
    if isinstance(request, Pause):
        if request.partition is None:
            return request.name, _dumps(at=at)
        partition = _count(request.partition, "partition", 0)
        if partition >= MAX_PARTITIONS:
            raise ValueError(f"partition must be below {MAX_PARTITIONS}, got {partition}")
        return request.name, _dumps(partition=partition, at=at)
    return request.name, _dumps(member=validate_member_id(request.member), at=at)


# -- key names: what a key's last segment says (the table partq.coordinator.store.kinds.KINDS uses)
# ---------


def partition_name(name: str) -> int:
    """The partition an assignment, claim or standby key is named by (5 digits)."""
    if not _PARTITION.fullmatch(name) or int(name) >= MAX_PARTITIONS:
        raise MalformedValue(f"the key names no partition: {name!r} (5 digits below 65536)")
    return int(name)


def member_name(name: str) -> str:
    """The member id a member key is named by."""
    return _name_id(name)


def candidate_name(name: str) -> str:
    """A leader candidate's name: its lease in hex (16 digits)."""
    if not _LEASE.fullmatch(name):
        raise MalformedValue(f"a leader candidate is named by its lease in hex, not {name!r}")
    return name


def parked_name(name: str) -> str:
    """The key id a parked record is named by (:func:`partq.producer.contract.key_id`)."""
    try:
        return _key_id(name)
    except ValueError as e:
        raise MalformedValue(str(e)) from None


def parse_drained_name(name: str) -> tuple[int, int]:
    """The (epoch, partition) a drained key's name, ``<epoch>/<partition:05d>``, names."""
    epoch, _, partition = name.partition("/")
    if not (epoch.isdigit() and epoch == str(int(epoch))):
        raise MalformedValue(f"the drained key names no epoch: {name!r} (<epoch>/<partition>)")
    return int(epoch), partition_name(partition)


def drained_name(name: str) -> str:
    """``name`` if it names a drained key (see :func:`parse_drained_name`)."""
    parse_drained_name(name)
    return name


def spec_name(name: str) -> str:
    """The spec key has no name of its own: ``name`` is the stream's."""
    return name


# The request grammar, parsed here and only here; :attr:`Rebalance.name` and its siblings write it.
_REQUEST_NAME = re.compile(
    r"(?P<rebalance>rebalance)|(?P<every>pause)"
    r"|move-(?P<move>0|[1-9][0-9]{0,4})|pause-(?P<pause>0|[1-9][0-9]{0,4})|drain-(?P<drain>.*)",
    re.DOTALL,
)
_REQUEST_NAMES = "rebalance, move-<p>, drain-<member>, pause, pause-<p>"


def parse_request_name(name: str) -> tuple[type[Request], int | str | None]:
    """Which request a request key's ``name`` holds and about what: (its class, the
    partition of a move or a pause, the member of a drain, else None)."""
    found = _REQUEST_NAME.fullmatch(name)
    if found is None:
        raise MalformedValue(f"no request is called {name!r} ({_REQUEST_NAMES})")
    if found["drain"] is not None:
        return Drain, _name_id(found["drain"])
    if found["move"] is not None:
        return Move, int(found["move"])
    if found["pause"] is not None:
        return Pause, int(found["pause"])
    return (Pause, None) if found["every"] else (Rebalance, None)


def request_name(name: str) -> str:
    """``name`` if it names a request (see :func:`parse_request_name`)."""
    parse_request_name(name)
    return name


# -- decoding: (stream, key name, raw value, lease) -> value -------------------------------------


def decode_member(_stream: str, name: str, raw: bytes | str, lease: int) -> Member:
    doc = _object(raw)
    if _str(doc, "id") != name:
        raise MalformedValue(f"'id' {doc['id']!r} is not the key's member id {name!r}")
    return Member(
        id=name,
        weight=_int(doc, "weight", 1, MAX_WEIGHT),
        lease=lease,
        host=_str(doc, "host"),
        pid=_int(doc, "pid", 0),
        version=_str(doc, "version"),
        started=_number(doc, "started"),
        leaving=_flag(doc, "leaving"),
        priority=_flag(doc, "priority"),
    )


def decode_assignment(_stream: str, _name: str, raw: bytes | str, _lease: int) -> Assignment:
    return Assignment(_id(_object(raw), "owner"))


def decode_claim(_stream: str, _name: str, raw: bytes | str, lease: int) -> Claim:
    doc = _object(raw)
    takeover = _flag(doc, "takeover")
    source = _id(doc, "from") if takeover else ""
    return Claim(
        _id(doc, "member"),
        lease,
        _number(doc, "at"),
        takeover,
        source,
        _int(doc, "priority", 0, MAX_PRIORITY) if "priority" in doc else 0,
        _flag(doc, "sealed"),
        _flag(doc, "live"),
    )


def decode_standby(_stream: str, _name: str, raw: bytes | str, _lease: int) -> Standby:
    return Standby(_id(_object(raw), "member"))


def decode_candidate(_stream: str, name: str, raw: bytes | str, lease: int) -> Candidate:
    """A candidate on the lease its name gives; one on no lease or another lease was not
    put by a campaign (:meth:`partq.coordinator.store.group.Group.stand`) and never leads:
    on no lease it would never go."""
    if raw not in (b"", ""):
        raise MalformedValue("a leader candidate's value is empty")
    if lease != int(name, 16):
        on = f"on lease {lease:016x}" if lease else "on no lease"
        raise MalformedValue(f"a leader candidate is on the lease its name gives, not {on}")
    return Candidate(int(name, 16))


def decode_request(_stream: str, name: str, raw: bytes | str, _lease: int) -> Request:
    kind, _about = parse_request_name(name)
    doc = _object(raw)
    at = _number(doc, "at")
    request: Request
    if kind is Move:
        request = Move(_int(doc, "partition", 0), _id(doc, "to"), at)
    elif kind is Drain:
        request = Drain(_id(doc, "member"), at)
    elif kind is Pause:
        request = Pause(_int(doc, "partition", 0) if name != "pause" else None, at)
    else:
        request = Rebalance(at)
    if request.name != name:
        raise MalformedValue(f"the value is request {request.name!r}, not the key's {name!r}")
    return request


def decode_parked(_stream: str, name: str, raw: bytes | str, _lease: int) -> Parked:
    doc = _object(raw)
    return Parked(
        name,
        _int(doc, "partition", 0),
        _str(doc, "error"),
        _str(doc, "error_type"),
        _str(doc, "message_id"),
        _id(doc, "member"),
        _number(doc, "at"),
        _str(doc, "redrive") if "redrive" in doc else "",
        _str(doc, "redrive_error") if "redrive" in doc else "",
        _long_key(name, doc),
    )


def decode_spec(scope: str, _name: str, raw: bytes | str, _lease: int) -> StreamSpec:
    """The stream's spec, naming the queues of the group ``scope`` names."""
    stream, group = split_scope(scope)
    try:
        spec = StreamSpec.from_json(raw)
    except UsageError as e:  # a version this partq does not understand
        raise MalformedValue(str(e)) from None
    if spec.name != stream:
        raise MalformedValue(f"the spec of stream {spec.name!r} is not {stream!r}'s")
    return spec.in_group(group)


def decode_drained(_stream: str, name: str, raw: bytes | str, _lease: int) -> Drained:
    """A resize's fence handled (written by ``partq.consumers.control.resizing``:
    ``{"member"}``)."""
    epoch, partition = parse_drained_name(name)
    doc = _object(raw)
    return Drained(
        epoch, partition, _id(doc, "member"), _seal(_str(doc, "seal")) if "seal" in doc else ""
    )


def decode_resize(_stream: str, _name: str, raw: bytes | str, _lease: int) -> ResizeState:
    """A resize's record (:func:`partq.coordinator.leader.resize.decode`)."""
    return resize.decode(raw)


def _seal(seal: str) -> str:
    """A fence's seal as a resize makes them (:func:`partq.producer.contract.is_seal`)."""
    if not is_seal(seal):
        raise MalformedValue(f"a fence's seal is 32 hex digits, not {_shown(seal)}")
    return seal


def _long_key(name: str, doc: dict[str, Any]) -> bytes:
    """A long key's bytes from its record, checked against the digest that names it."""
    if not long_key_id(name):
        return b""
    try:
        key = base64.b64decode(_str(doc, "key"), validate=True)
    except ValueError:  # binascii.Error
        raise MalformedValue("'key' is not base64") from None
    if key_id(key) != name:
        raise MalformedValue(f"'key' is not the key that {name} names")
    return key


def _key_id(name: str) -> str:
    if not _KEY_ID.fullmatch(name):
        raise ValueError(f"a parked key is named by its unpadded base64url bytes, not {name!r}")
    return name


def _object(raw: bytes | str) -> dict[str, Any]:
    try:
        doc = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise MalformedValue(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise MalformedValue(f"not a JSON object but {type(doc).__name__}")
    if "v" not in doc:
        raise MalformedValue('no version "v"')
    version = doc["v"]
    if type(version) is not int or version != VERSION:
        raise MalformedValue(f"version {version!r} is not understood by this partq ({VERSION})")
    return doc


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number partq writes")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent; one too big for a float (``1e999``, which
    Python reads as infinity) is no number partq writes."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _field(doc: dict[str, Any], field: str) -> Any:
    if field not in doc:
        raise MalformedValue(f"no {field!r}")
    return doc[field]


def _str(doc: dict[str, Any], field: str) -> str:
    value = _field(doc, field)
    if not isinstance(value, str):
        raise MalformedValue(f"{field!r} is not a string: {value!r}")
    return value


def _int(doc: dict[str, Any], field: str, minimum: int, maximum: int | None = None) -> int:
    value = _field(doc, field)
    if type(value) is not int or value < minimum:
        raise MalformedValue(f"{field!r} is not a whole number of at least {minimum}: {value!r}")
    if maximum is not None and value > maximum:
        raise MalformedValue(f"{field!r} is not at most {maximum}: {_shown(value)}")
    return value


def _flag(doc: dict[str, Any], field: str) -> bool:
    """An optional true/false field (absent: false)."""
    value = doc.get(field, False)
    if not isinstance(value, bool):
        raise MalformedValue(f"{field!r} is not true or false: {value!r}")
    return value


def _number(doc: dict[str, Any], field: str) -> float:
    value = _field(doc, field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedValue(f"{field!r} is not a number: {value!r}")
    if not -MAX_NUMBER <= value <= MAX_NUMBER:  # an int no float holds too
        raise MalformedValue(f"{field!r} is not a number within {MAX_NUMBER:g}: {_shown(value)}")
    return float(value)


def _id(doc: dict[str, Any], field: str) -> str:
    value = _str(doc, field)
    try:
        return validate_member_id(value)
    except InvalidMemberId:
        raise MalformedValue(f"{field!r} is not a valid member id: {value!r}") from None


def _name_id(name: str) -> str:
    try:
        return validate_member_id(name)
    except InvalidMemberId:
        raise MalformedValue(f"the key names an invalid member id {name!r}") from None
