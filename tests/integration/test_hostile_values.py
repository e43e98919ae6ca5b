"""Every key kind a partq identity may write, written with hostile values, against a real
etcd with auth and the roles ``partq security roles`` makes: nothing hangs, no partition
waits more than two lease TTLs, per-key order holds, and every rejection is counted.

One stream runs for the whole table (a coordinator and the consumers ``c-1`` and ``c-2``,
each on its own identity; :mod:`tests.integration.etcdsite`). Each row writes one value as
an identity whose rights cover that key, then: a message of every partition is handled
within two TTLs (plus the publishing), in order; the processes live and the
coordinator's page answers; ``partq_forged_removed_total`` or
``partq_etcd_malformed_values_total``, summed over the processes, grew. The stream is then
put back (the hostile key deleted if still there) and balanced before the next row. The
coordinator balances by load (``--balance load --load-interval 1``), so it reads the load
reports every second.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from partq.coordinator.store import codec

from partq.kernel import keys
from partq.kernel.etcd import connect, etcd_errors
from tests.integration.etcdsite import (
    MEMBERS,
    PARTITIONS,
    PORTS,
    Site,
    etcd_site,
    keys_of,
    publish_and_wait,
    running,
)
from tests.integration.groups.harness import Fleet, balanced
from tests.polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAM = f"hv-{uuid.uuid4().hex[:8]}"
TTL = 3
LOAD = ("--balance", "load", "--load-interval", "1")  # the leader reads the load reports
REJECTIONS = ("partq_forged_removed_total", "partq_etcd_malformed_values_total")


@dataclass
class World:
    """What a row's writer knows: the group, a client per identity, c-2's lease, and one
    partition of each member."""

    site: Site
    group: Any
    fleet: Fleet
    clients: dict[str, Any]
    c2_lease: int
    of_c2: int
    of_c1: int
    written: str = ""  # the last hostile value put


@dataclass(frozen=True)
class Row:
    kind: str
    writer: str  # the identity: "c-1" (any consumer), "c-2" (the member named), "coordinator"
    value: str  # what is hostile about it
    write: Callable[[World], str]  # writes it; returns the key written


def put(w: World, who: str, key: str, value: str, *, lease: int = 0, txn: bool = False) -> str:
    """Put as ``who``: plainly, or (``txn``) in a transaction, where etcd 3.4 checks no
    lease."""
    client = w.clients[who]
    w.written = value
    with etcd_errors("test"):
        if txn:
            t = client.transactions
            client.transaction(compare=[], success=[t.put(key, value, lease=lease)], failure=[])
        else:
            client.put(key, value, lease=lease or None)
    return key


def doc(**fields: Any) -> str:
    """A value as partq encodes them, with ``v`` 1; floats that JSON cannot hold (inf, NaN)
    written as Python's json writes them (``Infinity``, ``NaN``)."""
    return json.dumps({"v": 1, **fields}, sort_keys=True)


def claim(w: World, p: int) -> str:
    return keys.claim(STREAM, p)


def parked_key(w: World) -> tuple[str, str]:
    key = keys_of(w.of_c2, 1)[0]
    from partq.producer.contract import key_id

    return key, keys.parked(STREAM, key_id(key))


def load_doc(w: World, rates: Any) -> str:
    return doc(member="c-2", at=time.time(), interval=5.0, rates=rates)


def member_doc(**over: Any) -> str:
    fields: dict[str, Any] = {
        "id": "c-2",
        "weight": 1,
        "host": "h",
        "pid": 1,
        "version": "0",
        "started": time.time(),
    }
    fields.update(over)
    return doc(**fields)


def parked_doc(w: World, **over: Any) -> str:
    fields: dict[str, Any] = {
        "partition": w.of_c2,
        "error": "forged",
        "error_type": "X",
        "message_id": "m",
        "member": "c-2",
        "at": time.time(),
    }
    fields.update(over)
    return doc(**fields)


ROWS = [
    # claims/: any consumer may write there
    Row("claim", "c-1", "on no lease, in c-2's name", lambda w: put(
        w, "c-1", claim(w, w.of_c2), codec.encode_claim("c-2", 1.0))),
    Row("claim", "c-1", "a takeover from c-1 in c-2's name on c-2's lease", lambda w: put(
        w, "c-1", claim(w, w.of_c1),
        doc(member="c-2", at=time.time(), takeover=True, **{"from": "c-1"}, live=True),
        lease=w.c2_lease, txn=True)),
    Row("claim", "c-1", "c-1's partition in c-2's name on c-2's lease", lambda w: put(
        w, "c-1", claim(w, w.of_c1), codec.encode_claim("c-2", time.time()),
        lease=w.c2_lease, txn=True)),
    Row("claim", "c-1", "a member of the wrong type", lambda w: put(
        w, "c-1", claim(w, w.of_c2), doc(member=5, at=1.0))),
    Row("claim", "c-1", "an infinite time on c-2's lease", lambda w: put(
        w, "c-1", claim(w, w.of_c2), doc(member="c-2", at=float("inf")),
        lease=w.c2_lease, txn=True)),
    Row("claim", "c-1", "NaN for a time on c-2's lease", lambda w: put(
        w, "c-1", claim(w, w.of_c2), doc(member="c-2", at=float("nan")),
        lease=w.c2_lease, txn=True)),
    Row("claim", "c-1", "a huge priority on c-2's lease", lambda w: put(
        w, "c-1", claim(w, w.of_c2), doc(member="c-2", at=1.0, priority=10**30),
        lease=w.c2_lease, txn=True)),
    # parked/: any consumer may write there
    Row("parked", "c-1", "c-2's key in c-2's name, on no lease", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w))),
    Row("parked", "c-1", "c-2's key in c-1's name", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w, member="c-1"))),
    Row("parked", "c-1", "c-2's key in c-2's name on c-2's lease", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w), lease=w.c2_lease, txn=True)),
    Row("parked", "c-1", "a partition out of range", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w, partition=99_999))),
    Row("parked", "c-1", "a negative partition", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w, partition=-1))),
    Row("parked", "c-1", "NaN for a time", lambda w: put(
        w, "c-1", parked_key(w)[1], parked_doc(w, at=float("nan")))),
    # load/c-2 and members/c-2: only c-2's own identity may write them
    Row("load", "c-2", "an infinite rate", lambda w: put(
        w, "c-2", keys.load(STREAM, "c-2"), load_doc(w, {str(w.of_c2): float("inf")}),
        lease=w.c2_lease)),
    Row("load", "c-2", "two rates whose sum is infinite", lambda w: put(
        w, "c-2", keys.load(STREAM, "c-2"), load_doc(w, {"0": 1e308, "1": 1e308}),
        lease=w.c2_lease)),
    Row("load", "c-2", "a negative rate", lambda w: put(
        w, "c-2", keys.load(STREAM, "c-2"), load_doc(w, {"0": -5.0}), lease=w.c2_lease)),
    Row("load", "c-2", "rates of the wrong type", lambda w: put(
        w, "c-2", keys.load(STREAM, "c-2"), load_doc(w, [1, 2]), lease=w.c2_lease)),
    Row("member", "c-2", "a huge weight", lambda w: put(
        w, "c-2", keys.member(STREAM, "c-2"), member_doc(weight=10**9), lease=w.c2_lease)),
    Row("member", "c-2", "a weight of the wrong type", lambda w: put(
        w, "c-2", keys.member(STREAM, "c-2"), member_doc(weight="x"), lease=w.c2_lease)),
    Row("member", "c-2", "another process's weight", lambda w: put(
        w, "c-2", keys.member(STREAM, "c-2"), member_doc(weight=7), lease=w.c2_lease)),
    # leader/ and standby/: the coordinator's identity
    Row("leader", "coordinator", "a candidate on no lease", lambda w: put(
        w, "coordinator", keys.leader_candidate(STREAM, 0xFFFFFFFFFFFFFFFF), "")),
    Row("leader", "coordinator", "a candidate on a consumer's lease", lambda w: put(
        w, "coordinator", keys.leader_candidate(STREAM, w.c2_lease), "",
        lease=w.c2_lease, txn=True)),
    Row("standby", "coordinator", "a member that does not exist", lambda w: put(
        w, "coordinator", keys.standby(STREAM, w.of_c2), doc(member="ghost"))),
    Row("standby", "coordinator", "a member of the wrong type", lambda w: put(
        w, "coordinator", keys.standby(STREAM, w.of_c2), doc(member=[1]))),
]  # fmt: skip


def metric(port: int, names: tuple[str, ...]) -> float:
    """The sum of every sample of ``names`` on the process at ``port`` (0: not answering)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(names):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rejections() -> float:
    return sum(metric(port, REJECTIONS) for port in PORTS.values())


def settled_rejections() -> float:
    """The count once two reads 0.5 s apart agree (at most 10 tries)."""
    last = rejections()
    for _ in range(10):
        time.sleep(0.5)
        now, last = last, rejections()
        if now == last:
            break
    return last


def replaced(w: World, row: Row, key: str) -> bool:
    """A load report the member replaced with its own before any reader met it: it was
    never used, so nothing had to reject it."""
    if row.kind != "load":
        return False
    with etcd_errors("test"):
        raw, _meta = w.clients["root"].get(key)
    return raw is not None and raw.decode() != w.written


def page_answers() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['coordinator']}/", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, rabbitmq: str) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("hostile")
    with (
        etcd_site(tmp, rabbitmq, []) as site,
        running(site, STREAM, ttl=TTL, coordinator=LOAD) as world,
    ):
        group, fleet, _hostile = world
        clients = {
            who: connect(site.settings(who, STREAM)) for who in ("c-1", "c-2", "coordinator")
        }
        root = connect(site.settings("root", STREAM))
        clients["root"] = root
        try:
            state = group.snapshot()
            yield World(
                site,
                group,
                fleet,
                clients,
                state.members["c-2"].lease,
                min(p for p, o in state.assignment.items() if o == "c-2"),
                min(p for p, o in state.assignment.items() if o == "c-1"),
            )
        finally:
            for client in clients.values():
                client.close()


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.kind}: {r.value}" for r in ROWS])
def test_a_hostile_value_stops_nothing_and_is_counted(world: World, row: Row) -> None:
    w = world
    state = w.group.snapshot()
    w.c2_lease = state.members["c-2"].lease
    w.of_c2 = min(p for p, o in state.assignment.items() if o == "c-2")
    w.of_c1 = min(p for p, o in state.assignment.items() if o == "c-1")
    before = settled_rejections()  # an earlier row's late count cannot pass this one
    key = row.write(w)
    try:
        # every partition handled within two lease TTLs (plus publishing), in order
        every = [keys_of(p, 1)[0] for p in range(PARTITIONS)]
        took = publish_and_wait(w.site, w.group, w.fleet, every, by=None, timeout=2 * TTL + 8)
        assert page_answers(), "the coordinator's page does not answer"  # reads load reports
        wait_until(
            lambda: rejections() > before or replaced(w, row, key),
            2 * TTL + 5,
            0.2,
            "the rejection counted",
        )
        assert all(p.alive() for p in w.fleet.procs), w.fleet.logs()
        print(f"{row.kind} by {row.writer}, {row.value}: handled in {took:.2f} s")
    finally:
        with etcd_errors("test"):
            raw, _meta = w.clients["root"].get(key)
        if raw is not None and row.kind not in ("member", "load"):
            w.clients["root"].delete(key)
        wait_until(lambda: balanced(w.group, PARTITIONS, set(MEMBERS)), 30, 0.2, "balanced again")
