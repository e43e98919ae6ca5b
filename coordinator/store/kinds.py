"""Every kind of key in a stream's group: one row each, the one place a kind is defined.

A row says where the kind's keys live (their prefix, from :mod:`partq.kernel.keys`, which formats
every key), what a key's name may be and what it means (a partition, a member id, a
request's name...), how its value is decoded (:mod:`partq.coordinator.store.codec`) and which field
of
:class:`partq.coordinator.store.mirror.GroupState` holds it (``revisions``: the field of its keys'
mod
revisions, where readers need them). Reading a key (:func:`kind_of`), decoding it
(:func:`decode`) and mirroring it all go through the row; adding a kind is adding a row
(and its field).

=============  ===========================  ======================  ===================
kind           prefix under the stream      name                    mirror field
=============  ===========================  ======================  ===================
member         ``members/``                 member id               ``members``
assignment     ``assignment/``              partition (5 digits)    ``assignment``
claim          ``claims/``                  partition (5 digits)    ``claims``
standby        ``standby/``                 partition (5 digits)    ``standbys``
leader         ``leader/``                  lease (16 hex digits)   ``candidates``
request        ``requests/``                a request's name        ``requests``
parked         ``parked/``                  key id                  ``parked``
drained        ``drained/``                 ``<epoch>/<partition>``  ``drained``
spec           ``spec`` (the key itself)    (the stream)            ``spec``
resize         ``resize`` (the key itself)  (the stream)            ``resize``
=============  ===========================  ======================  ===================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, get_args

from partq.coordinator.store import codec
from partq.coordinator.store.codec import Value

from partq.kernel import keys
from partq.kernel.errors import MalformedValue

__all__ = [
    "KINDS",
    "KeyKind",
    "Kind",
    "Malformed",
    "WatchEvent",
    "check_name",
    "decode",
    "kind_of",
    "valid_name",
]

Kind = Literal[
    "member",
    "assignment",
    "claim",
    "standby",
    "leader",
    "request",
    "parked",
    "drained",
    "spec",
    "resize",
]


def _value(event: WatchEvent) -> object:
    return event.value


@dataclass(frozen=True, slots=True)
class KeyKind:
    """One kind of group key (see the module docstring)."""

    kind: Kind
    prefix: Callable[[str], str]  # stream -> the prefix of its keys (spec: the key)
    name: Callable[[str], int | str]  # a key's name -> its mirror key; MalformedValue if none
    decode: Callable[[str, str, bytes | str, int], Value]  # (stream, name, raw, lease)
    mirror: str  # the GroupState field holding this kind's keys
    held: Callable[[WatchEvent], object] = _value  # what of a change the field holds
    revisions: str | None = None  # the GroupState field of their mod revisions, if kept

    @property
    def exact(self) -> bool:
        """Whether the prefix is the one key of this kind (the spec, the resize record)."""
        return self.kind in ("spec", "resize")

    def key(self, stream: str, name: str) -> str:
        return self.prefix(stream) if self.exact else f"{self.prefix(stream)}{name}"


def _partition_name(name: str) -> int | str:
    return codec.partition_name(name)


def _owner(event: WatchEvent) -> object:
    return event.value.owner if isinstance(event.value, codec.Assignment) else None


def _member(event: WatchEvent) -> object:
    return event.value.member if isinstance(event.value, codec.Standby) else None


def _created(event: WatchEvent) -> object:
    return event.created if event.value is not None else None


KINDS: Final[Mapping[Kind, KeyKind]] = {
    row.kind: row
    for row in (
        KeyKind("member", keys.members, codec.member_name, codec.decode_member, "members"),
        KeyKind(
            "assignment",
            keys.assignments,
            _partition_name,
            codec.decode_assignment,
            "assignment",
            held=_owner,
        ),
        KeyKind(
            "claim",
            keys.claims,
            _partition_name,
            codec.decode_claim,
            "claims",
            revisions="claim_revisions",
        ),
        KeyKind(
            "standby",
            keys.standbys,
            _partition_name,
            codec.decode_standby,
            "standbys",
            held=_member,
        ),
        KeyKind(
            "leader",
            keys.leader_prefix,
            codec.candidate_name,
            codec.decode_candidate,
            "candidates",
            held=_created,
        ),
        KeyKind("request", keys.requests, codec.request_name, codec.decode_request, "requests"),
        KeyKind(
            "parked",
            keys.parked_keys,
            codec.parked_name,
            codec.decode_parked,
            "parked",
            revisions="parked_revisions",
        ),
        KeyKind("drained", keys.drained_all, codec.drained_name, codec.decode_drained, "drained"),
        KeyKind("spec", keys.spec, codec.spec_name, codec.decode_spec, "spec"),
        KeyKind("resize", keys.resize, codec.spec_name, codec.decode_resize, "resize"),
    )
}
assert set(KINDS) == set(get_args(Kind)), "a kind without its row, or a row without its kind"


def kind_of(stream: str, key: str) -> tuple[KeyKind, str] | None:
    """The kind of ``stream``'s group key ``key`` and its name (the spec's: the stream), or
    None for a key of no kind."""
    for row in KINDS.values():
        prefix = row.prefix(stream)
        if row.exact:
            if key == prefix:
                return row, stream
        elif key.startswith(prefix):
            return row, key[len(prefix) :]
    return None


def check_name(kind: str, name: str) -> None:
    """:class:`MalformedValue` unless ``name`` is one partq gives a key of ``kind``."""
    row = KINDS.get(kind)  # type: ignore[call-overload]
    if row is None:
        raise ValueError(f"unknown kind of key {kind!r}")
    row.name(name)


def valid_name(kind: str, name: str) -> bool:
    """Whether ``name`` is one partq gives a key of ``kind`` (see :func:`check_name`)."""
    try:
        check_name(kind, name)
    except MalformedValue:
        return False
    return True


def decode(kind: str, stream: str, name: str, raw: bytes | str, lease: int = 0) -> Value:
    """The value of ``stream``'s key of ``kind`` called ``name`` (the part after the kind's
    prefix), stored as ``raw`` on ``lease``; :class:`MalformedValue` if partq did not write it.
    """
    check_name(kind, name)
    return KINDS[kind].decode(stream, name, raw, lease)  # type: ignore[index]


@dataclass(frozen=True, slots=True)
class Malformed:
    """A key whose value partq did not write: ignored, and shown by ``partq status``."""

    key: str
    kind: str
    error: str
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change of one group key (a snapshot's keys are read as such changes too).

    ``value`` is the decoded value, or None when the key was deleted or its new value is
    malformed (then ``malformed`` says why): either way, the key is absent now.
    """

    kind: Kind
    name: str
    value: Value | None  # None: deleted, or malformed
    lease: int = 0
    revision: int = 0  # the change's (the key's mod revision)
    malformed: str | None = None
    created: int = 0  # the key's create revision (0 for a delete)

    @property
    def partition(self) -> int:
        """The partition of an assignment or claim event (its name was checked on decoding)."""
        return int(self.name)
