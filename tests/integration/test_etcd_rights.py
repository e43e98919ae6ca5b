"""The etcd rights of ``partq security roles``, against a real etcd with auth, and what the
readers make of what those rights still allow.

Given a private etcd (TLS, auth) with every role of :func:`partq.coordinator.ops.rights.roles`
applied through :mod:`partq.coordinator.ops.grants`: each role may do exactly what its rights say
(read, write and delete of one key of every kind, for every role), and nothing through
another member's lease. With a coordinator and two consumers running on those identities
(RabbitMQ: the machine's broker), a consumer's credentials writing a claim without a lease
in another member's name, or a parked record for a partition they do not hold, stop
nothing: the claim is ignored and deleted, the record ignored and deleted, and the
messages flow.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.ops.rights import Role, roles
from partq.coordinator.store import codec
from partq.coordinator.store.codec import Parked
from partq.producer.contract import key_id

from partq.kernel import keys
from partq.kernel.errors import EtcdPermissionDenied
from partq.kernel.etcd import connect, etcd_errors, lease_is
from tests.integration.etcdsite import (
    MEMBERS,
    Site,
    claim_on,
    etcd_site,
    keys_of,
    publish_and_wait,
    running,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAM = f"er-{uuid.uuid4().hex[:8]}"
GRACE = 2.0  # coordinator --unbound-grace (etcdsite.running's)
GROUP = f"{STREAM}~audit"  # a second consumer group of the stream (docs/groups.md)
ROLES = {  # + the shared one, and the second group's
    r.name: r for r in [*roles(STREAM), *roles(STREAM, MEMBERS), *roles(GROUP)]
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, rabbitmq: str) -> Iterator[Site]:
    with etcd_site(tmp_path_factory.mktemp("etcd-rights"), rabbitmq, list(ROLES.values())) as s:
        yield s


# -- every role, every kind of key: what etcd allows is what the rights say --------------

PROBES = {  # one key of every kind in the layout, and keys of another stream
    "spec": keys.spec(STREAM),
    "member c-1": keys.member(STREAM, "c-1"),
    "member c-2": keys.member(STREAM, "c-2"),
    "leader": keys.leader_candidate(STREAM, 0xABC),
    "assignment": keys.assignment(STREAM, 0),
    "claim": keys.claim(STREAM, 0),
    "standby": keys.standby(STREAM, 0),
    "request": keys.request(STREAM, "rebalance"),
    "parked": keys.parked(STREAM, key_id("k")),
    "resize": keys.resize(STREAM),
    "drained": keys.drained(STREAM, 0, 3),
    "load c-1": keys.load(STREAM, "c-1"),
    "load c-2": keys.load(STREAM, "c-2"),
    "group audit's claim": keys.claim(GROUP, 0),
    "group audit's member": keys.member(GROUP, "a-1"),
    "group audit's record": keys.group_record(STREAM, "audit"),
    "group other's record": keys.group_record(STREAM, "other"),
    "other stream's spec": keys.spec("other"),
    "other stream's load": keys.load("other", "c-1"),
}


def permits(role: Role, op: str, key: str) -> bool:
    """What etcd's RBAC makes of ``role``'s rights: a right covers its key, or every key
    under it; reading needs read, putting and deleting need write."""
    need = "read" if op == "get" else "write"
    return any(
        (key == r.key or (r.prefix and key.startswith(r.key))) and need in r.permission
        for r in role.etcd
    )


def attempt(client: Any, op: str, key: str) -> bool:
    """Whether etcd lets ``client`` do ``op`` on ``key`` (False: permission denied)."""
    try:
        with etcd_errors("test"):
            if op == "get":
                client.get(key)
            elif op == "put":
                client.put(key, "{}")
            else:
                client.delete(key)
    except EtcdPermissionDenied:
        return False
    return True


def test_each_role_may_do_exactly_what_its_rights_say(site: Site) -> None:
    # Given: every role applied; When: each identity gets, puts and deletes one key of
    # every kind; Then: etcd allows exactly what permits() reads from roles()
    seen: dict[tuple[str, str, str], bool] = {}
    expected: dict[tuple[str, str, str], bool] = {}
    for name, role in sorted(ROLES.items()):
        client = connect(site.settings(name, STREAM))
        try:
            for what, key in PROBES.items():
                for op in ("get", "put", "delete"):
                    seen[name, op, what] = attempt(client, op, key)
                    expected[name, op, what] = permits(role, op, key)
        finally:
            client.close()
    wrong = {k: v for k, v in seen.items() if expected[k] != v}
    assert wrong == {}, f"etcd allowed (True) or refused (False) against the rights: {wrong}"
    # every role is allowed something and refused something
    for name in ROLES:
        outcomes = {v for (who, _, _), v in seen.items() if who == name}
        assert outcomes == {True, False}, name
    print(  # the numbers for the report
        f"{len(seen)} operations: {sum(seen.values())} allowed, "
        f"{len(seen) - sum(seen.values())} refused, as the rights say"
    )


def test_a_consumer_cannot_put_anything_on_another_members_lease(site: Site) -> None:
    # Given: c-2's member key on c-2's lease
    c1, c2 = connect(site.settings("c-1", STREAM)), connect(site.settings("c-2", STREAM))
    try:
        lease = c2.lease(30)
        with etcd_errors("test"):
            c2.put(keys.member(STREAM, "c-2"), "{}", lease=lease)
        t = c1.transactions
        claim = keys.claim(STREAM, 3)
        # When: c-1 puts a claim on that lease, or revokes it: Then etcd refuses both
        with pytest.raises(EtcdPermissionDenied), etcd_errors("test"):
            c1.put(claim, codec.encode_claim("c-2", 1.0), lease=lease)
        with pytest.raises(EtcdPermissionDenied), etcd_errors("test"):
            c1.revoke_lease(lease.id)
        # But etcd 3.4 does not check a lease's keys for a put inside a transaction: the
        # claim lands on c-2's lease in c-2's name. It is what a hand-over writes, and lasts
        # no longer than c-2 (which releases a partition it is granted but not assigned).
        with etcd_errors("test"):
            ok, _ = c1.transaction(
                compare=[lease_is(keys.member(STREAM, "c-2"), lease.id)],
                success=[t.put(claim, codec.encode_claim("c-2", 1.0), lease=lease)],
                failure=[],
            )
        assert ok, "etcd now checks leases in transactions: tighten docs/security.md"
        lease.revoke()
        assert c2.get(claim)[0] is None  # gone with c-2's lease
    finally:
        c1.close()
        c2.close()


# -- what those rights still allow, and what the readers make of it ----------------------


def test_a_lease_less_claim_in_another_members_name_stops_nothing(site: Site) -> None:
    with running(site, f"{STREAM}-c") as (group, fleet, hostile):
        state = group.snapshot()
        victim = min(p for p, owner in state.assignment.items() if owner == "c-2")
        c2_lease = state.members["c-2"].lease
        # When: c-1's credentials put a claim on c-2's partition in c-2's name, on no lease
        began = time.monotonic()
        with etcd_errors("test"):
            hostile.put(keys.claim(group.stream, victim), codec.encode_claim("c-2", 1.0))
        # Then: the claim is back on c-2's lease (c-2 replaces a lease-less claim, or the
        # leader deletes it) and the partition's messages are handled by c-2
        wait_until(lambda: claim_on(group, victim) == c2_lease, 20, 0.05, "c-2's claim back")
        back = time.monotonic() - began
        took = publish_and_wait(site, group, fleet, keys_of(victim, 5))
        # When: they put one in c-2's name on a lease of their own that holds no member key
        # (honoured, as a departed member's while it drains; only the leader removes it)
        lease = hostile.lease(60)
        began = time.monotonic()
        with etcd_errors("test"):
            hostile.put(
                keys.claim(group.stream, victim), codec.encode_claim("c-2", 1.0), lease=lease
            )
        wait_until(lambda: claim_on(group, victim) == c2_lease, 20, 0.05, "c-2's claim again")
        again = time.monotonic() - began
        lease.revoke()
        logs = fleet.procs[0].log.read_text()
        assert f"deleted the claim on partition {victim} naming c-2 on lease {lease.id:x}" in logs
        assert GRACE <= again < GRACE + 10
        took_again = publish_and_wait(site, group, fleet, keys_of(victim, 5)[:1])
        print(
            f"lease-less claim: c-2's claim back after {back:.2f} s, 25 messages handled "
            f"{took:.2f} s after publishing; claim on a spare lease: back after {again:.2f} s "
            f"(grace {GRACE} s), "
            f"then handled in {took_again:.2f} s"
        )


def test_a_parked_record_for_a_partition_not_held_is_ignored_and_removed(site: Site) -> None:
    with running(site, f"{STREAM}-p") as (group, fleet, hostile):
        state = group.snapshot()
        victim = min(p for p, owner in state.assignment.items() if owner == "c-2")
        # When: c-1's credentials park a key of c-2's partition, in c-1's name
        key = keys_of(victim, 1)[0]
        forged = Parked(key_id(key), victim, "forged", "X", "m", "c-1", 1.0)
        with etcd_errors("test"):
            hostile.put(keys.parked(group.stream, forged.key_id), codec.encode_parked(forged))
        # Then: the leader deletes it, c-2 ignored it, and the key's messages reach c-2
        wait_until(lambda: not group.parked(), 20, 0.05, "the forged record deleted")
        took = publish_and_wait(site, group, fleet, [key])
        assert "deleted the parked record of key" in fleet.procs[0].log.read_text()
        # (a member whose watch saw the record before the leader deleted it ignored it: c-1
        # always, it names c-1 on a partition c-1 does not hold; c-2 unless the delete came first on
        # a busy machine)
        logs = {m: Path(fleet.tmp / f"{m}.log").read_text() for m in MEMBERS}
        ignored = [
            m for m, text in logs.items() if f"ignoring the parked record of key {key} " in text
        ]
        assert ignored, logs
        print(f"forged parked record: removed; the key's 5 messages handled in {took:.2f} s")


def test_a_groups_identities_reach_its_own_keys_and_the_streams_not_another_groups(
    site: Site,
) -> None:
    # Given the default group's shared consumer and group audit's consumer and operator
    default = connect(site.settings(f"partq-{STREAM}-consumer", STREAM))
    audit = connect(site.settings(f"partq-{GROUP}-consumer", STREAM))
    operator = connect(site.settings(f"partq-{GROUP}-operator", STREAM))
    try:
        # Then audit's consumer reads the stream's spec and resize record and its own keys
        for key in (keys.spec(STREAM), keys.resize(STREAM), keys.claim(GROUP, 0)):
            assert attempt(audit, "get", key), key
        assert attempt(audit, "put", keys.member(GROUP, "a-1"))
        # And neither the default group's keys nor another group's record
        for key in (keys.claim(STREAM, 0), keys.member(STREAM, "c-1"), keys.parked(STREAM, "x")):
            assert not attempt(audit, "get", key), key
            assert not attempt(audit, "put", key), key
        assert not attempt(audit, "get", keys.group_record(STREAM, "other"))
        assert not attempt(operator, "get", keys.claim(STREAM, 0))
        # And the default group's consumer reaches none of audit's keys
        for key in (keys.claim(GROUP, 0), keys.member(GROUP, "a-1")):
            assert not attempt(default, "get", key), key
            assert not attempt(default, "put", key), key
    finally:
        for client in (default, audit, operator):
            client.close()
