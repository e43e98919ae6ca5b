"""The resize of a stream's partitions as a state machine, pure: ``step(state, event) ->
(state, actions)``. The protocol and its reasons are in docs/resize.md.

::

    REQUESTED ──declared──▶ DECLARED ──cut──▶ CUT ──fenced (every old p)──▶ FENCED
      new queues,            old-epoch          a fence at the tail of      │
      no binding yet         bindings gone      each old queue        bound │
                                                                            ▼
    SWITCHED ◀──────────────switched──────────────── BOUND: new-epoch bindings exist
      producers publish the new layout
      │
      └─drained (every old p)──▶ DRAINED ──deleted (every retired p)──▶ RETIRED
          every old p handled      queues only the old layout            done
          its fence                had, deleted if empty

The order is what keeps per-key order: the old bindings go *before* the fences, so no
old-layout message can land behind a fence (a late one is returned to its producer, which
re-routes it under the new layout); the new bindings come *after* the fences, so in a
queue both layouts share every new-layout message is behind the fence. A consumer then
handles a new-layout message of a key that moved only once its old partition handled its
fence (``drained``): :meth:`partq.producer.layout.Resize.may_handle`.

The leading coordinator (the shell, not written yet) writes the state to etcd, fenced by
its leadership, *before* it carries out the actions; every action is idempotent (declare,
unbind, bind, a second fence, the switch as a compare-and-set, a delete of an empty
queue), so a leader that died anywhere resumes from the stored record with
:class:`Resumed` and does again whatever is not recorded as done. A queue is deleted only
after its fence was handled, with no binding left to fill it, and only once the broker
counts no message in it; a queue found not empty stays (``NotEmpty``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from partq.producer.contract import MAX_PARTITIONS, seal_digest
from partq.producer.layout import Layout, Resize

from partq.kernel.errors import MalformedValue, UsageError

__all__ = [
    "Action",
    "Bind",
    "Bound",
    "Cut",
    "Declare",
    "Declared",
    "Delete",
    "Deleted",
    "Drained",
    "Event",
    "Fence",
    "Fenced",
    "NotEmpty",
    "Phase",
    "Resumed",
    "State",
    "Switch",
    "Switched",
    "Unbind",
    "begin",
    "command_line",
    "decode",
    "encode",
    "pending",
    "ranges",
    "served",
    "step",
    "summary",
    "summary_lines",
    "waiting",
]

VERSION = 1
_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_SEALS = 64  # fences of one old queue: one each run of the command that fenced it


class Phase(Enum):
    REQUESTED = "requested"  # the record is written: declare the new queues
    DECLARED = "declared"  # the new queues exist, unbound: cut the old bindings
    CUT = "cut"  # old-layout publishes are returned: fence every old queue
    FENCED = "fenced"  # a fence ends the old layout in every old queue: bind the new epoch
    BOUND = "bound"  # the new bindings exist: switch the layout in etcd
    SWITCHED = "switched"  # producers publish the new layout: wait for every fence's handling
    DRAINED = "drained"  # every old message is handled: delete the queues only the old had
    RETIRED = "retired"  # done; the record stays as history until the next resize


_ORDER = list(Phase)


# -- events (what the shell saw) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Declared:
    """The queues the new layout adds exist (declared, no binding)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """Every binding of the old epoch is gone."""


@dataclass(frozen=True, slots=True)
class Fenced:
    """The broker confirmed a fence of the old epoch into old ``partition``'s queue."""

    partition: int


@dataclass(frozen=True, slots=True)
class Bound:
    """Every binding of the new epoch exists."""


@dataclass(frozen=True, slots=True)
class Switched:
    """etcd holds the new layout (the compare-and-set took, or found it done)."""


@dataclass(frozen=True, slots=True)
class Drained:
    """Old ``partition``'s consumer handled its fence (etcd record of the ``epoch``)."""

    epoch: int
    partition: int


@dataclass(frozen=True, slots=True)
class Deleted:
    """Retired ``partition``'s queue is gone (deleted if empty, or found absent)."""

    partition: int


@dataclass(frozen=True, slots=True)
class NotEmpty:
    """The broker refused to delete retired ``partition``'s queue: it has messages."""

    partition: int


@dataclass(frozen=True, slots=True)
class Resumed:
    """A leader took over (or a retry is due): do again whatever is not done."""


Event = Declared | Cut | Fenced | Bound | Switched | Drained | Deleted | NotEmpty | Resumed


# -- actions (what the shell does; each idempotent) ------------------------------------------


@dataclass(frozen=True, slots=True)
class Declare:
    """Declare these partition queues, with no binding."""

    partitions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Unbind:
    """Remove the binding of every partition of ``layout`` (its epoch's routing keys)."""

    layout: Layout


@dataclass(frozen=True, slots=True)
class Fence:
    """Publish, confirmed, a fence of ``epoch`` into ``partition``'s queue."""

    epoch: int
    partition: int


@dataclass(frozen=True, slots=True)
class Bind:
    """Bind every partition of ``layout`` under its epoch's routing keys."""

    layout: Layout


@dataclass(frozen=True, slots=True)
class Switch:
    """Put ``new`` in etcd if it still holds ``old`` (a compare-and-set)."""

    old: Layout
    new: Layout


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete ``partition``'s queue only if it is empty: ``if-empty`` for a classic queue;
    a quorum queue does not support the flag (RabbitMQ closes the connection, 540), so the
    shell counts its messages (a passive declare) and deletes it only at 0. Nothing can
    fill it meanwhile: it has no binding left (tests/integration/test_resize_broker.py)."""

    partition: int


Action = Declare | Unbind | Fence | Bind | Switch | Delete


@dataclass(frozen=True, slots=True)
class State:
    """One resize: where it is, and which per-partition steps are done."""

    resize: Resize
    phase: Phase = Phase.REQUESTED
    fenced: frozenset[int] = frozenset()
    drained: frozenset[int] = frozenset()
    deleted: frozenset[int] = frozenset()
    # retired queues the broker would not delete (messages in them): retried on Resumed
    not_empty: frozenset[int] = frozenset()
    # (old partition, seal_digest) of each fence published; None in a record written by a
    # partq that sealed no fence (any drained record of it is believed)
    seals: frozenset[tuple[int, str]] | None = frozenset()

    @property
    def running(self) -> bool:
        return self.phase is not Phase.RETIRED

    def sealed_by(self, partition: int, seal: str) -> bool:
        """Whether a drained record of old ``partition`` carrying ``seal`` was written by
        whoever consumed one of its fences: only they saw the seal, which etcd keeps as a
        digest. Any other was put with a consumer's credentials and is not believed."""
        return self.seals is None or (partition, seal_digest(seal)) in self.seals


def begin(
    current: Layout, partitions: int, running: State | None, maximum: int = MAX_PARTITIONS
) -> tuple[State, list[Action]]:
    """A new resize of ``current`` to ``partitions``; :class:`UsageError` in one line for a
    resize while another runs, a count out of ``1..maximum`` or equal to the current."""
    if running is not None and running.running:
        target = running.resize.new.partitions
        raise UsageError(
            f"a resize to {target} partitions is already running ({running.phase.value}): "
            f"wait for it to finish before asking for another"
        )
    state = State(current.resize(partitions, maximum))
    return state, pending(state)


def pending(state: State) -> list[Action]:
    """Every action the current phase still needs (what a resuming leader does again)."""
    change = state.resize
    match state.phase:
        case Phase.REQUESTED:
            return [Declare(tuple(change.added))]
        case Phase.DECLARED:
            return [Unbind(change.old)]
        case Phase.CUT:
            old = range(change.old.partitions)
            return [Fence(change.old.epoch, p) for p in old if p not in state.fenced]
        case Phase.FENCED:
            return [Bind(change.new)]
        case Phase.BOUND:
            return [Switch(change.old, change.new)]
        case Phase.DRAINED:
            return [Delete(p) for p in change.retired if p not in state.deleted]
        case Phase.SWITCHED | Phase.RETIRED:  # waiting for consumers; done
            return []


def step(state: State, event: Event) -> tuple[State, list[Action]]:
    """Record ``event``; when it completes the phase, move on and return the next work."""
    if isinstance(event, Resumed):
        return state, pending(state)
    after = _record(state, event)
    if after == state:  # a repeat, or an answer to work of another phase: nothing new
        return state, []
    advanced = _advance(after)
    return advanced, (pending(advanced) if advanced.phase is not state.phase else [])


def _record(state: State, event: Event) -> State:
    """``state`` with ``event`` noted, if it belongs to the current phase (or, for
    ``Drained``, to any phase after the cut: consumers may handle a fence at once)."""
    phase, change = state.phase, state.resize
    match event:
        case Declared() if phase is Phase.REQUESTED:
            return replace(state, phase=Phase.DECLARED)
        case Cut() if phase is Phase.DECLARED:
            return replace(state, phase=Phase.CUT)
        case Fenced(p) if phase is Phase.CUT and 0 <= p < change.old.partitions:
            return replace(state, fenced=state.fenced | {p})
        case Bound() if phase is Phase.FENCED:
            return replace(state, phase=Phase.BOUND)
        case Switched() if phase is Phase.BOUND:
            return replace(state, phase=Phase.SWITCHED)
        case Drained(epoch, p) if (
            epoch == change.old.epoch
            and 0 <= p < change.old.partitions
            and _ORDER.index(phase) >= _ORDER.index(Phase.CUT)
        ):
            return replace(state, drained=state.drained | {p})
        case Deleted(p) if phase is Phase.DRAINED and p in change.retired:
            return replace(state, deleted=state.deleted | {p}, not_empty=state.not_empty - {p})
        case NotEmpty(p) if phase is Phase.DRAINED and p in change.retired:
            return replace(state, not_empty=state.not_empty | {p})
    return state


def _advance(state: State) -> State:
    """The next phase once every per-partition step of this one is done."""
    old = frozenset(range(state.resize.old.partitions))
    if state.phase is Phase.CUT and state.fenced == old:
        return replace(state, phase=Phase.FENCED)
    if state.phase is Phase.SWITCHED and state.drained == old:
        state = replace(state, phase=Phase.DRAINED)
    if state.phase is Phase.DRAINED and state.deleted == frozenset(state.resize.retired):
        return replace(state, phase=Phase.RETIRED)
    return state


def waiting(state: State) -> dict[int, tuple[int, ...]]:
    """For ``partq status``: each new partition with some key still gated, and the old
    partitions it waits on (their fence not handled yet)."""
    if not state.running:
        return {}
    change = state.resize
    gates = {
        q: tuple(p for p in change.gated(q) if p not in state.drained)
        for q in range(change.new.partitions)
    }
    return {q: parents for q, parents in gates.items() if parents}


def grown(state: State | None) -> int | None:
    """The new count of a running grow whose added queues are declared, else None: they
    are assigned and consumed from then on, so that their consumers are subscribed when
    the new layout's first messages arrive after the switch (empty and unbound before)."""
    if state is None or not state.running or state.phase is Phase.REQUESTED:
        return None
    change = state.resize
    return change.new.partitions if change.new.partitions > change.old.partitions else None


def served(partitions: int, state: State | None, drained: Iterable[tuple[int, int]] = ()) -> int:
    """How many partitions the coordinator assigns for a spec of ``partitions`` while
    ``state`` is the stream's last resize: the spec's; during a grow, its new count from
    the declare on (:func:`grown`); and during a shrink after its switch also the retired
    partitions whose fence is not handled yet (their old-layout messages still need a
    consumer; partq assigns a prefix ``0 … n-1``, so up to the highest of them). A retired
    partition that drained is given up, so that its queue, empty and without a consumer,
    can be deleted. Drained means recorded so in ``state`` or among ``drained``, the
    (epoch, partition) pairs of the consumers' own keys (:func:`partq.kernel.keys.drained`): the
    command that advances the record may have returned (no ``--wait``) long before."""
    if (count := grown(state)) is not None:
        return max(partitions, count)
    if state is None or not state.running or state.resize.new.partitions != partitions:
        return partitions
    handled = state.drained | _of_epoch(drained, state.resize.old.epoch)
    draining = [p for p in state.resize.retired if p not in handled]
    return max(partitions, max(draining, default=-1) + 1)


def _of_epoch(drained: Iterable[tuple[int, int]], epoch: int) -> frozenset[int]:
    """The partitions of ``epoch`` among the (epoch, partition) pairs ``drained``."""
    return frozenset(partition for of, partition in drained if of == epoch)


def summary(state: State) -> dict[str, Any]:
    """The record as ``partq status``, ``stream describe`` and the status page show it."""
    change, running = state.resize, state.running
    return {
        "from": change.old.partitions,
        "to": change.new.partitions,
        "epoch": change.new.epoch,
        "phase": state.phase.value,
        "running": running,
        # old partitions whose fence is not handled yet (every one until the cut)
        "draining": sorted(set(range(change.old.partitions)) - state.drained) if running else [],
        "retiring": sorted(set(change.retired) - state.deleted) if running else [],
        "not_empty": sorted(state.not_empty),
        "waiting": {str(q): list(parents) for q, parents in waiting(state).items()},
    }


def summary_lines(doc: dict[str, Any], stream: str) -> list[str]:
    """:func:`summary` as lines of text (none for a resize that retired)."""
    if not doc["running"]:
        return []
    head = f"resize {doc['from']} -> {doc['to']} partitions (epoch {doc['epoch']}): {doc['phase']}"
    lines = [head]
    if doc["draining"]:
        lines.append(
            f"  old partitions still draining (fence not handled): {ranges(doc['draining'])}"
        )
    waiting = doc["waiting"]
    if waiting:
        shown = "; ".join(f"{q} on {ranges(ps)}" for q, ps in list(waiting.items())[:8])
        more = f"; +{len(waiting) - 8} more" if len(waiting) > 8 else ""
        lines.append(f"  gates closed (new partition on old ones): {shown}{more}")
    if doc["retiring"]:
        lines.append(f"  queues to delete once drained and empty: {ranges(doc['retiring'])}")
    if doc["not_empty"]:
        lines.append(f"  retired queues not empty or still consumed: {ranges(doc['not_empty'])}")
    lines.append(f"  continue or finish it with: {command_line(stream, doc['to'], wait=True)}")
    return lines


def command_line(stream: str, partitions: int, *, wait: bool) -> str:
    """The ``partq stream resize`` command that continues the resize of ``stream`` to
    ``partitions`` (with ``wait``: until it retires), as the messages tell it to run."""
    return f"partq stream resize {stream} --partitions {partitions}" + (" --wait" if wait else "")


def ranges(partitions: Iterable[int]) -> str:
    """Partitions ``[0, 1, 2, 5]`` as ``0-2, 5`` (``-`` for none)."""
    runs: list[list[int]] = []
    for p in sorted(partitions):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


# -- the etcd record -------------------------------------------------------------------------


def encode(state: State) -> str:
    """The record as stored in etcd (JSON, keys sorted)."""
    change = state.resize
    return json.dumps(
        {
            "v": VERSION,
            "old": {"epoch": change.old.epoch, "partitions": change.old.partitions},
            "new": {"epoch": change.new.epoch, "partitions": change.new.partitions},
            "phase": state.phase.value,
            "fenced": sorted(state.fenced),
            "drained": sorted(state.drained),
            "deleted": sorted(state.deleted),
            "not_empty": sorted(state.not_empty),
            **({} if state.seals is None else {"seals": sorted(map(list, state.seals))}),
        },
        sort_keys=True,
    )


def decode(raw: str | bytes) -> State:
    """The record :func:`encode` wrote; :class:`MalformedValue` saying why for anything else."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("v") != VERSION:
            raise ValueError(f"not a version {VERSION} object")
        change = Resize(_layout(doc["old"]), _layout(doc["new"]))
        state = State(change, Phase(doc["phase"]))
        return replace(
            state,
            fenced=_partitions(doc["fenced"], change.old.partitions),
            drained=_partitions(doc["drained"], change.old.partitions),
            deleted=_partitions(doc["deleted"], change.old.partitions),
            not_empty=_partitions(doc["not_empty"], change.old.partitions),
            seals=_seals(doc["seals"], change.old.partitions) if "seals" in doc else None,
        )
    except (ValueError, KeyError, TypeError) as e:  # UsageError is a ValueError
        raise MalformedValue(f"malformed resize record: {e!r}") from None


def _layout(doc: Any) -> Layout:
    if not isinstance(doc, dict) or set(doc) != {"epoch", "partitions"}:
        raise ValueError(f"a layout is {{epoch, partitions}}, not {doc!r}")
    return Layout(doc["partitions"], doc["epoch"])


def _seals(doc: Any, below: int) -> frozenset[tuple[int, str]]:
    if not isinstance(doc, list) or len(doc) > _MAX_SEALS * below:
        raise ValueError(f"not a list of at most {_MAX_SEALS} seals a partition: {doc!r:.100}")
    return frozenset(_seal(pair, below) for pair in doc)


def _seal(pair: Any, below: int) -> tuple[int, str]:
    ok = isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
    if not ok or not 0 <= pair[0] < below or not _DIGEST.fullmatch(str(pair[1])):
        raise ValueError(f"a seal is [partition below {below}, sha256 hex], not {pair!r:.100}")
    return pair[0], pair[1]


def _partitions(doc: Any, below: int) -> frozenset[int]:
    if not isinstance(doc, list) or not all(type(p) is int and 0 <= p < below for p in doc):
        raise ValueError(f"not a list of partitions below {below}: {doc!r}")
    return frozenset(doc)
