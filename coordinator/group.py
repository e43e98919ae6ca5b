"""The consumer-group client API on etcd: membership, assignment, claims, and a watch.

Consumers use this module (never key strings); the coordinator uses it too.
Values are small versioned JSON documents (``{"v": 1, ...}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import etcd3.exceptions

from coordinator import keys
from coordinator.errors import EtcdUnavailable, MemberIdTaken
from coordinator.etcd import etcd_errors, lease_is
from coordinator.session import Session

__all__ = ["Claim", "Group", "GroupState", "Member", "WatchEvent"]

log = logging.getLogger("partq.group")


def _doc(**fields: Any) -> str:
    return json.dumps({"v": 1, **fields}, sort_keys=True)


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    weight: int = 1
    lease: int = 0
    host: str = ""
    pid: int = 0
    version: str = ""
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class Claim:
    member: str
    lease: int
    at: float = 0.0


@dataclass(frozen=True)
class GroupState:
    """One consistent read of a stream's group keys, at ``revision``."""

    revision: int
    members: dict[str, Member] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    claims: dict[int, Claim] = field(default_factory=dict)
    leaders: list[tuple[int, str]] = field(default_factory=list)  # (create revision, key)
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change under the stream: ``kind`` is member/assignment/claim/leader/request/spec."""

    kind: str
    name: str
    value: dict[str, Any] | None  # None: deleted
    lease: int = 0
    revision: int = 0


def _kind(stream: str, key: str) -> tuple[str, str] | None:
    for kind, prefix in (
        ("member", keys.members(stream)),
        ("assignment", keys.assignments(stream)),
        ("claim", keys.claims(stream)),
        ("leader", keys.leader_prefix(stream)),
        ("request", keys.requests(stream)),
    ):
        if key.startswith(prefix):
            return kind, key[len(prefix) :]
    if key == keys.spec(stream):
        return "spec", stream
    return None


class Group:
    """One stream's group keys."""

    def __init__(self, client: Any, where: str, stream: str) -> None:
        self.client = client
        self.where = where
        self.stream = stream

    # -- reading -----------------------------------------------------------------------

    def snapshot(self) -> GroupState:
        with etcd_errors(self.where):
            response = self.client.get_prefix_response(keys.stream_prefix(self.stream))
        state = GroupState(revision=response.header.revision)
        for kv in response.kvs:
            found = _kind(self.stream, kv.key.decode())
            if found is None:
                continue
            kind, name = found
            value = json.loads(kv.value) if kind != "leader" else {}
            if kind == "member":
                state.members[name] = _member(name, value, kv.lease)
            elif kind == "assignment":
                state.assignment[int(name)] = value["owner"]
            elif kind == "claim":
                state.claims[int(name)] = Claim(value["member"], kv.lease, value.get("at", 0.0))
            elif kind == "leader":
                state.leaders.append((kv.create_revision, kv.key.decode()))
            elif kind == "request":
                state.requests[name] = value
        state.leaders.sort()
        return state

    def watch(self, revision: int, callback: Callable[[WatchEvent | Exception], None]) -> int:
        """Call ``callback`` for every change after ``revision`` (or with an error)."""

        def on_response(response: Any) -> None:
            if response is None or isinstance(response, Exception):  # the stream ended
                callback(EtcdUnavailable(f"watch on {self.stream} ended: {response}"))
                return
            for event in response.events:
                key = event.key.decode()
                found = _kind(self.stream, key)
                if found is None:
                    continue
                kind, name = found
                deleted = type(event).__name__ == "DeleteEvent"
                value = None if deleted else (json.loads(event.value) if event.value else {})
                callback(
                    WatchEvent(kind, name, value, getattr(event, "lease", 0), event.mod_revision)
                )

        with etcd_errors(self.where):
            watch_id: int = self.client.add_watch_prefix_callback(
                keys.stream_prefix(self.stream), on_response, start_revision=revision + 1
            )
        return watch_id

    def cancel_watch(self, watch_id: int) -> None:
        try:
            with etcd_errors(self.where):
                self.client.cancel_watch(watch_id)
        except EtcdUnavailable:
            pass

    # -- membership --------------------------------------------------------------------

    def join(self, session: Session, member_id: str, weight: int = 1, version: str = "") -> None:
        """Register ``member_id`` on ``session``'s lease; refused if another live one has it.

        A key left by a crashed instance of the same member (a restarted pod) is
        waited out once, for at most its lease's remaining TTL.
        """
        existing = self._try_join(session, member_id, weight, version)
        if existing is None:
            return
        with etcd_errors(self.where):
            remaining = self.client.get_lease_info(existing).TTL
        deadline = time.monotonic() + max(0, remaining) + 2  # TTL is truncated; expiry ticks
        log.info("member id %s is held by lease %x for up to %ss: waiting", member_id, existing,
                 remaining)  # fmt: skip
        while existing is not None and (left := deadline - time.monotonic()) > 0:
            with etcd_errors(self.where), contextlib.suppress(etcd3.exceptions.WatchTimedOut):
                self.client.watch_once(keys.member(self.stream, member_id), timeout=left)
            existing = self._try_join(session, member_id, weight, version)
        if existing is None:
            return
        raise MemberIdTaken(
            f"member id {member_id!r} is already used by a live consumer of {self.stream!r} "
            f"(lease {existing:x}): give this one another --member-id, or stop the other one"
        )

    def _try_join(self, session: Session, member_id: str, weight: int, version: str) -> int | None:
        """Put the member key if absent; None if it is ours now, else the holder's lease."""
        if weight < 1:
            raise ValueError(f"weight must be at least 1, got {weight}")
        key = keys.member(self.stream, member_id)
        value = _doc(
            id=member_id, weight=weight, host=socket.gethostname(), pid=os.getpid(),
            version=version, started=time.time(),
        )  # fmt: skip
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.version(key) == 0],
                success=[t.put(key, value, lease=session.lease)],
                failure=[t.get(key)],
            )
        if ok:
            return None
        existing = responses[0][0][1] if responses and responses[0] else None
        if existing is None or existing.lease_id == session.id:
            return None
        return int(existing.lease_id)

    def leave(self, member_id: str, session: Session) -> None:
        key = keys.member(self.stream, member_id)
        t = self.client.transactions
        with etcd_errors(self.where):
            self.client.transaction(
                compare=[lease_is(key, session.id)], success=[t.delete(key)], failure=[]
            )

    # -- claims ------------------------------------------------------------------------

    def claim(self, partition: int, member_id: str, session: Session) -> int:
        """Create our claim on ``partition`` if nobody holds one.

        Returns the claim's mod revision if it is ours now (truthy), else 0. A
        caller mirroring the claims from the watch ignores events up to that
        revision: they are older than what it knows.
        """
        key = keys.claim(self.stream, partition)
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[t.version(key) == 0],
                success=[t.put(key, _doc(member=member_id, at=time.time()), lease=session.lease)],
                failure=[t.get(key)],
            )
        if ok:
            return int(responses[0].response_put.header.revision)
        existing = responses[0][0][1] if responses and responses[0] else None
        if existing is not None and existing.lease_id == session.id:
            return int(existing.mod_revision)
        return 0

    def release(self, partition: int, session: Session) -> int:
        """Delete our claim on ``partition`` (only if it is ours): the delete's revision, or 0."""
        key = keys.claim(self.stream, partition)
        t = self.client.transactions
        with etcd_errors(self.where):
            ok, responses = self.client.transaction(
                compare=[lease_is(key, session.id)], success=[t.delete(key)], failure=[]
            )
        return int(responses[0].response_delete_range.header.revision) if ok else 0

    # -- operator requests (manual mode) --------------------------------------------------

    def request(self, name: str, **fields: Any) -> None:
        with etcd_errors(self.where):
            self.client.put(keys.request(self.stream, name), _doc(**fields, at=time.time()))

    def clear_request(self, name: str) -> None:
        with etcd_errors(self.where):
            self.client.delete(keys.request(self.stream, name))


def _member(name: str, value: dict[str, Any], lease: int) -> Member:
    return Member(
        id=name,
        weight=int(value.get("weight", 1)),
        lease=lease,
        host=str(value.get("host", "")),
        pid=int(value.get("pid", 0)),
        version=str(value.get("version", "")),
        started=float(value.get("started", 0.0)),
    )
