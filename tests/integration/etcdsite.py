"""A private etcd with TLS and auth, the roles of ``partq security roles`` applied, and a
stream run on those identities: what the hostile-value tests share.

:func:`etcd_site` starts the etcd (ended when the context ends); :func:`running` creates a
stream, starts a coordinator and the consumers ``c-1`` and ``c-2`` each on its own
identity (RabbitMQ: the machine's broker), waits until they are balanced, and deletes the
stream after.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.ops import grants
from partq.coordinator.ops.rights import Role, roles
from partq.coordinator.store.group import Group
from partq.producer import Producer
from partq.producer.contract import partition_for
from partq.producer.registry import Registry

from examples import audit
from partq.kernel import keys
from partq.kernel.etcd import connect
from partq.kernel.local import LocalEtcd, free_port
from partq.kernel.settings import Settings
from tests.conftest import AMQP_URL
from tests.integration.groups.harness import PARTQ, ROOT, Fleet, balanced
from tests.pki import loopback_server_tls
from tests.polling import wait_until

__all__ = [
    "MEMBERS",
    "PARTITIONS",
    "Site",
    "claim_on",
    "etcd_site",
    "keys_of",
    "publish_and_wait",
    "running",
    "user",
]

PARTITIONS = 4
MEMBERS = ("c-1", "c-2")
PORTS: dict[str, int] = {}  # the HTTP port of each process running() started
_ROUNDS = itertools.count()  # publish_and_wait's calls: each sends higher seqs


def user(who: str, stream: str) -> str:
    """The etcd user of ``who`` (a component, a member, root, or a role's own name)."""
    if who == "root" or who.startswith("partq-"):
        return who
    return f"partq-{stream}-consumer-{who}" if who in MEMBERS else f"partq-{stream}-{who}"


@dataclass
class Site:
    tmp: Path
    ca: Path
    etcd: LocalEtcd
    passwords: Path

    def env(self, who: str, stream: str) -> dict[str, str]:
        name = user(who, stream)
        return {
            "PARTQ_ETCD_ENDPOINTS": self.etcd.endpoint,
            "PARTQ_ETCD_CA": str(self.ca),
            "PARTQ_ETCD_USER": name,
            "PARTQ_ETCD_PASSWORD_FILE": str(self.passwords / name),
            "PARTQ_AMQP_URL": os.environ.get("PARTQ_TEST_AMQP_URL", AMQP_URL),
        }

    def settings(self, who: str, stream: str) -> Settings:
        values = {k.removeprefix("PARTQ_").lower(): v for k, v in self.env(who, stream).items()}
        return Settings.load(**values)

    def grant(self, found: list[Role]) -> None:
        """Apply ``found`` as etcd's root, each user with a fresh password file."""
        for role in found:
            (self.passwords / role.name).write_text(secrets.token_urlsafe(18) + "\n")
        root = connect(self.settings("root", ""))
        try:
            grants.apply_etcd(root, found, self.passwords, no_password=False)
        finally:
            root.close()

    def partq(self, who: str, *args: str, stream: str) -> str:
        command = [str(PARTQ), *args]
        env = {**os.environ, **self.env(who, stream), "PYTHONPATH": str(ROOT)}
        try:
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                                  check=True).stdout  # fmt: skip
        except subprocess.CalledProcessError as e:
            raise AssertionError(f"partq {' '.join(args)}: {e.stderr[-2000:]}") from None


@contextlib.contextmanager
def etcd_site(tmp: Path, rabbitmq: str, granted: list[Role]) -> Iterator[Site]:
    """A private TLS etcd with auth on, ``granted`` applied; stopped when done."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    tls = loopback_server_tls(tmp)
    passwords = tmp / "passwords"
    passwords.mkdir()
    (passwords / "root").write_text(secrets.token_urlsafe(18) + "\n")
    etcd = LocalEtcd(tls=tls, auth_token_ttl=30)
    etcd.start()
    try:
        etcd.enable_auth((passwords / "root").read_text().strip())
        site = Site(tmp, tls.ca, etcd, passwords)
        os.environ.setdefault("PARTQ_TEST_AMQP_URL", rabbitmq)
        site.grant(granted)
        yield site
    finally:
        etcd.stop()


def keys_of(partition: int, count: int, partitions: int = PARTITIONS) -> list[str]:
    """``count`` message keys that hash to ``partition``."""
    found = [f"k{i}" for i in range(10_000) if partition_for(f"k{i}", partitions) == partition]
    return found[:count]


@contextlib.contextmanager
def running(
    site: Site, stream: str, *, grace: float = 2.0, ttl: int = 3, coordinator: tuple[str, ...] = ()
) -> Iterator[tuple[Group, Fleet, Any]]:
    """``stream`` created, balanced over c-1 and c-2 with a coordinator, each on its own
    identity: (the admin's view of the group, the fleet, c-1's etcd client: the hostile
    writer)."""
    site.grant(roles(stream, MEMBERS))
    site.partq("admin", "stream", "create", stream, "--partitions", str(PARTITIONS), stream=stream)
    record = site.tmp / f"{stream}.jsonl"
    tmp = site.tmp / stream
    tmp.mkdir()
    fleets = [
        Fleet(stream, tmp, site.etcd.endpoint, "", record, env=site.env(who, stream))
        for who in ("coordinator", *MEMBERS)
    ]
    admin = Registry.connect(site.settings("admin", stream))
    hostile = connect(site.settings("c-1", stream))
    try:
        ports = {who: free_port() for who in ("coordinator", *MEMBERS)}
        fleets[0].coordinator(
            ttl=ttl,
            extra=(
                "--unbound-grace",
                str(grace),
                "--http-port",
                str(ports["coordinator"]),
                *coordinator,
            ),
        )
        for fleet, member in zip(fleets[1:], MEMBERS, strict=True):
            fleet.consumer(member, ttl=ttl, extra=("--http-port", str(ports[member])))
        PORTS.update(ports)
        group = Group(admin.client, admin.where, stream)
        wait_until(lambda: balanced(group, PARTITIONS, set(MEMBERS)), 60, 0.2, "balanced")
        yield (
            group,
            Fleet(stream, tmp, "", "", record, procs=[p for f in fleets for p in f.procs]),
            hostile,
        )
    except AssertionError:
        print("\n".join(f.logs() for f in fleets))
        raise
    finally:
        hostile.close()
        for fleet in fleets:
            fleet.close()
        admin.close()
        site.partq("admin", "stream", "delete", stream, "--yes", stream=stream)


def publish_and_wait(
    site: Site,
    group: Group,
    fleet: Fleet,
    keys_: list[str],
    *,
    by: str | None = "c-2",
    timeout: float = 30.0,
) -> float:
    """Publish 5 messages of each key (seqs above every earlier call's); seconds until all
    are handled, each key in order (by ``by`` alone, unless None)."""
    base = next(_ROUNDS) * 5
    sent = {(k, base + n) for k in keys_ for n in range(5)}
    settings = site.settings("producer", group.stream)
    producer = Registry.connect(settings)
    began = time.monotonic()
    with Producer(group.stream, amqp_url=settings.amqp, etcd=producer) as p:
        for key, n in sorted(sent, key=lambda s: (s[1], s[0])):
            p.publish(key, json.dumps({"key": key, "seq": n}).encode(), message_id=f"{key}:{n}")
        p.flush(30)
    producer.close()

    def handled() -> set[tuple[str, int]]:
        if not fleet.record.exists():
            return set()
        return {(r["key"], r["seq"]) for r in fleet.records()}

    wait_until(lambda: handled() >= sent, timeout, 0.1, "the published messages handled")
    took = time.monotonic() - began
    records = fleet.records()
    if by is not None:
        assert {r["member"] for r in records if (r["key"], r["seq"]) in sent} == {by}
    assert audit.order_violations(records) == []
    return took


def claim_on(group: Group, partition: int) -> int:
    """The lease the partition's claim is on (-1: no claim)."""
    raw, meta = group.client.get(keys.claim(group.stream, partition))
    return -1 if raw is None else int(meta.lease_id)
