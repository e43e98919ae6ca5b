"""Least privilege: each component runs with its own etcd role and RabbitMQ user, and only that.

Given a private etcd (TLS, auth, 2 s tokens) and a private RabbitMQ node (TLS), both
started here on loopback, and the roles of ``partq security roles --apply``:
when the admin creates the stream, a coordinator and two consumers (each member its own
role) run and the producer publishes, every message is handled; and each identity is
refused what it must not do (the assignment, another member's key or lease, publishing
or consuming outside its part), with a claim written on the wrong lease reported by
``partq status``. No password shows in any output, log or command line.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from partq.coordinator.store import codec
from partq.coordinator.store.group import Group
from partq.producer import Producer
from partq.producer.contract import HEADER_CONTROL, HEADER_PARTITION, encode_key, park_queue
from partq.producer.registry import Registry

from examples import audit
from partq.kernel import keys
from partq.kernel.amqp import connect_blocking
from partq.kernel.errors import EtcdPermissionDenied, StreamNotFound, UsageError
from partq.kernel.etcd import connect, etcd_errors
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.integration.groups.harness import PARTQ, ROOT, Fleet, balanced
from tests.pki import loopback_server_tls
from tests.polling import wait_until
from tests.rabbit import Install, PrivateRabbit

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAM = "lp"
PARTITIONS = 4
MEMBERS = ("c-1", "c-2")
USERS = {
    "root": "root",
    "admin": f"partq-{STREAM}-admin",
    "producer": f"partq-{STREAM}-producer",
    "coordinator": f"partq-{STREAM}-coordinator",
    "operator": f"partq-{STREAM}-operator",
    "c-1": f"partq-{STREAM}-consumer-c-1",
    "c-2": f"partq-{STREAM}-consumer-c-2",
    # the second consumer group, audit (docs/groups.md)
    "audit-consumer": f"partq-{STREAM}~audit-consumer",
    "audit-coordinator": f"partq-{STREAM}~audit-coordinator",
    "audit-operator": f"partq-{STREAM}~audit-operator",
}


@dataclass
class Site:
    """The private servers, the password files and everything printed so far."""

    tmp: Path
    ca: Path
    etcd: LocalEtcd
    rabbit: PrivateRabbit
    passwords: Path
    secret: dict[str, str]
    outputs: list[str]

    def env(self, who: str) -> dict[str, str]:
        """PARTQ_* for identity ``who``: etcd user + password file, amqps user + password file."""
        user = USERS[who]
        return {
            "PARTQ_ETCD_ENDPOINTS": self.etcd.endpoint,
            "PARTQ_ETCD_CA": str(self.ca),
            "PARTQ_ETCD_USER": user,
            "PARTQ_ETCD_PASSWORD_FILE": str(self.passwords / user),
            "PARTQ_AMQP_URL": f"amqps://{user}@localhost:{self.rabbit.tls_port}/%2F",
            "PARTQ_AMQP_CA": str(self.ca),
            "PARTQ_AMQP_PASSWORD_FILE": str(self.passwords / user),
        }

    def settings(self, who: str) -> Settings:
        values = {k.removeprefix("PARTQ_").lower(): v for k, v in self.env(who).items()}
        return Settings.load(**values)

    def partq(
        self, who: str, *args: str, extra: dict[str, str] | None = None, fails: bool = False
    ) -> str:
        """partq's stdout (its stderr when ``fails``: it must then exit non-zero)."""
        env = {**os.environ, **self.env(who), **(extra or {}), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [str(PARTQ), *args], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        self.outputs += [done.stdout, done.stderr]
        if fails:
            assert done.returncode != 0, f"partq {' '.join(args)} did not fail: {done.stdout}"
            return done.stderr
        assert done.returncode == 0, f"partq {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, rabbit_install: Install) -> Iterator[Site]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    tmp = tmp_path_factory.mktemp("least-privilege")
    tls = loopback_server_tls(tmp)
    passwords = tmp / "passwords"
    passwords.mkdir()
    secret = {user: secrets.token_urlsafe(18) for user in USERS.values()}
    for user, password in secret.items():
        (passwords / user).write_text(password + "\n")
    etcd = LocalEtcd(tls=tls, auth_token_ttl=2)
    rabbit = PrivateRabbit(
        tmp / "rabbit", tls.cert, tls.key, tls.ca, name="partqlp", install=rabbit_install
    )
    etcd.start()
    try:
        etcd.enable_auth(secret["root"])
        rabbit.start()
        try:
            yield Site(tmp, tls.ca, etcd, rabbit, passwords, secret, [])
        finally:
            rabbit.stop()
    finally:
        etcd.stop()


def _amqp(site: Site, who: str) -> pika.BlockingConnection:
    return connect_blocking(site.settings(who).amqp, name=f"test-{who}")


def _refused(action: Any) -> int:
    """The reply code of the broker's refusal of ``action(channel)`` (0: not refused)."""
    try:
        action()
    except pika.exceptions.ChannelClosedByBroker as e:
        return int(e.reply_code)
    return 0


def _depth(site: Site, queue: str) -> int | None:
    """Messages in ``queue`` (None: it does not exist), as the admin sees it."""
    with _amqp(site, "admin") as connection:
        channel = connection.channel()
        try:
            return int(channel.queue_declare(queue, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker as e:
            assert e.reply_code == 404, e
            return None


def _dead_letters(site: Site) -> list[dict[str, Any]]:
    """The headers of every dead letter, taken off the DLQ by the admin."""
    found = []
    with _amqp(site, "admin") as connection:
        channel = connection.channel()
        for _ in range(100):
            method, properties, _body = channel.basic_get(f"partq.{STREAM}.dlq", auto_ack=True)
            if method is None:
                break
            found.append(dict(properties.headers or {}))
    return found


def _forged_purges_are_not_obeyed(site: Site, group: Group) -> None:
    """The producer's identity asks to purge the parked key k07: the SDK refuses the header;
    sent raw, RabbitMQ refuses a user_id not its own, and the consumer dead-letters the
    others unobeyed: k07 stays parked with every message it had."""
    (record,) = group.parked().values()
    parking = park_queue(STREAM, "k07")
    before = _depth(site, parking)
    assert before, "k07's parking queue holds its messages"
    registry = Registry.connect(site.settings("producer"))
    refused = pytest.raises(UsageError, match="header 'x-partq-control' is partq's own")
    try:
        with Producer(STREAM, amqp_url=site.settings("producer").amqp, etcd=registry) as p, refused:
            p.publish("k07", b"", headers={HEADER_CONTROL: "purge"})
    finally:
        registry.close()
    headers = {**encode_key("k07"), HEADER_PARTITION: record.partition, HEADER_CONTROL: "purge"}
    with _amqp(site, "producer") as connection:
        channel = connection.channel()
        channel.confirm_delivery()

        def send(user: str | None) -> None:
            properties = pika.BasicProperties(headers=headers, user_id=user, message_id=str(user))
            channel.basic_publish(f"partq.{STREAM}", str(record.partition), b"", properties)

        send(None)
        send(USERS["producer"])  # its own user: RabbitMQ lets it through, the consumer not
        assert _refused(lambda: send(USERS["operator"])) == 406  # PRECONDITION_FAILED
    wait_until(lambda: _depth(site, f"partq.{STREAM}.dlq") == 2, 30, 0.2, "2 dead letters")
    dead = _dead_letters(site)
    assert [h["x-partq-error-type"] for h in dead] == ["ForgedControl", "ForgedControl"]
    assert all("not obeyed" in h["x-partq-error"] for h in dead)
    assert set(group.parked()) == {record.key_id}
    assert _depth(site, parking) == before
    listed = site.partq("operator", "dlq", "list", STREAM)
    assert f"{'k07':<24} {record.partition:>9} {before:>8}" in listed


def test_each_component_works_with_its_own_role_and_nothing_more(site: Site) -> None:
    # Given: the roles applied by etcd's root (RabbitMQ through the node's rabbitmqctl)
    applied = site.partq(
        "root", "security", "roles", STREAM, *[f"--member={m}" for m in MEMBERS],
        "--apply", "--passwords", str(site.passwords), "--rabbitmqctl",
        str(site.rabbit.install.program("rabbitmqctl", site.tmp)), extra=dict(site.rabbit.env),
    )  # fmt: skip
    assert f"stream {STREAM}: 6 roles applied" in applied
    # When: the admin creates the stream; a coordinator and two consumers start
    site.partq("admin", "stream", "create", STREAM, "--partitions", str(PARTITIONS))
    record = site.tmp / "records.jsonl"
    flag = site.tmp / "poisoned"  # k07's messages from seq 5 on fail until it is deleted
    flag.touch()
    poison = {"PARTQ_POISON_KEY": "k07", "PARTQ_POISON_SEQ": "5", "PARTQ_POISON_FLAG": str(flag)}
    fleets = [
        Fleet(STREAM, site.tmp, site.etcd.endpoint, "", record, env={**site.env(who), **poison})
        for who in ("coordinator", *MEMBERS)
    ]
    admin = Registry.connect(site.settings("admin"))
    try:
        fleets[0].coordinator(ttl=3)
        for fleet, member in zip(fleets[1:], MEMBERS, strict=True):
            fleet.consumer(member, ttl=3, handler="poison_key", extra=("--max-attempts", "1"))
        group = Group(admin.client, admin.where, STREAM)
        wait_until(lambda: balanced(group, PARTITIONS, set(MEMBERS)), 60, 0.2, "balanced")
        cmdlines = [
            Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")
            for f in fleets
            for p in f.procs
        ]
        # ... and the producer publishes 40 keys x 10 with its own identity
        producer = Registry.connect(site.settings("producer"))
        sent = {(f"k{i:02d}", n) for n in range(10) for i in range(40)}
        with Producer(STREAM, amqp_url=site.settings("producer").amqp, etcd=producer) as p:
            for key, n in sorted(sent, key=lambda s: (s[1], s[0])):
                p.publish(key, json.dumps({"key": key, "seq": n}).encode(), message_id=f"{key}:{n}")
            p.flush(30)
        producer.close()

        # Then: every message is handled, in order per key
        def handled() -> set[tuple[str, int]]:
            return {(r["key"], r["seq"]) for r in audit.load(record)} if record.exists() else set()

        poisoned = {(k, n) for k, n in sent if k == "k07" and n >= 5}
        wait_until(lambda: handled() >= sent - poisoned, 60, 0.2, "the others handled")
        wait_until(group.parked, 30, 0.2, "k07 parked by the consumer's own rights")
        assert not handled() & poisoned
        # ... and only the operator (or admin) can have it purged
        _forged_purges_are_not_obeyed(site, group)
        # ... and the operator redrives k07 once the handler is fixed
        flag.unlink()
        redriven = site.partq("operator", "dlq", "redrive", STREAM, "--key", "k07")
        assert "k07 redriven and unparked" in redriven
        wait_until(lambda: handled() >= sent, 60, 0.2, "all messages handled")
        assert audit.order_violations(audit.load(record)) == []
        # ... and the admin purges k07 once it is parked again
        flag.touch()
        with Producer(STREAM, amqp_url=site.settings("producer").amqp, etcd=admin) as p:
            for n in (20, 21):
                p.publish("k07", json.dumps({"key": "k07", "seq": n}).encode())
        wait_until(lambda: _depth(site, park_queue(STREAM, "k07")) == 2, 30, 0.2, "parked")
        purged = site.partq("admin", "dlq", "purge", STREAM, "--key", "k07", "--yes")
        assert "k07 purged and unparked" in purged
        assert _depth(site, park_queue(STREAM, "k07")) is None
        flag.unlink()
        # ... and each member put its load report with its own rights (every 5 s)
        wait_until(lambda: set(group.loads()) == set(MEMBERS), 20, 0.2, "both load reports")

        # ... and each identity is refused what it must not do (etcd)
        state = group.snapshot()
        c2_lease = state.members["c-2"].lease
        denied = {
            ("c-1", "put", keys.assignment(STREAM, 0), 0),  # the assignment
            ("c-1", "put", keys.member(STREAM, "c-2"), 0),  # another member's key
            ("c-1", "put", keys.load(STREAM, "c-2"), 0),  # another member's load report
            ("c-1", "put", keys.claim(STREAM, 0), c2_lease),  # another member's lease
            ("c-1", "put", keys.spec(STREAM), 0),
            ("producer", "get", keys.members(STREAM), 0),
            ("producer", "put", keys.spec(STREAM), 0),
            ("coordinator", "put", keys.member(STREAM, "c-1"), 0),
            ("operator", "put", keys.assignment(STREAM, 1), 0),
            ("admin", "get", keys.spec("other"), 0),
        }
        for who, op, key, lease in sorted(denied):
            client = connect(site.settings(who))
            try:
                with pytest.raises(EtcdPermissionDenied) as refused, etcd_errors("test"):
                    if op == "get":
                        client.get_prefix(key)
                    else:
                        client.put(key, '{"owner": "x"}', lease=lease or None)
                site.outputs.append(str(refused.value))
                assert USERS[who] in str(refused.value), refused.value
            finally:
                client.close()

        # ... and RabbitMQ (403 ACCESS_REFUSED), while the consumer may dead-letter
        def publish(who: str, exchange: str, routing_key: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                channel.confirm_delivery()
                return _refused(lambda: channel.basic_publish(exchange, routing_key, b"x"))

        def consume(who: str, queue: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                return _refused(lambda: channel.basic_consume(queue, lambda *a: None))

        def declare(who: str, queue: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                return _refused(lambda: channel.queue_declare(queue, durable=True))

        assert publish("c-1", f"partq.{STREAM}", "0") == 403
        assert publish("c-1", "", f"partq.{STREAM}.p00000") == 403  # the default exchange
        assert publish("c-1", f"partq.{STREAM}.dlx", f"partq.{STREAM}.dlq") == 0
        assert publish("producer", "", f"partq.{STREAM}.dlq") == 403
        assert consume("producer", f"partq.{STREAM}.p00000") == 403
        assert consume("coordinator", f"partq.{STREAM}.p00001") == 403
        assert consume("c-1", f"partq.{STREAM}.dlq") == 403
        assert declare("c-1", "stolen") == 403
        assert declare("admin", "partq.other.p00000") == 403

        # ... and a hostile consumer's user is refused what RabbitMQ can refuse it
        def purge(who: str, queue: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                return _refused(lambda: channel.queue_purge(queue))

        def delete(who: str, queue: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                return _refused(lambda: channel.queue_delete(queue))

        def forge(who: str, user: str) -> int:
            with _amqp(site, who) as connection:
                channel = connection.channel()
                channel.confirm_delivery()
                properties = pika.BasicProperties(user_id=user)
                dlx, dlq = f"partq.{STREAM}.dlx", f"partq.{STREAM}.dlq"
                return _refused(lambda: channel.basic_publish(dlx, dlq, b"x", properties))

        partition, dead_letter_queue = f"partq.{STREAM}.p00001", f"partq.{STREAM}.dlq"
        assert delete("c-1", partition) == 403
        assert delete("c-1", dead_letter_queue) == 403
        assert purge("c-1", dead_letter_queue) == 403
        assert declare("c-1", f"partq.{STREAM}.park.x") == 403  # not a parking queue's name
        assert forge("c-1", USERS["operator"]) == 406
        with _amqp(site, "c-1") as connection:  # routing dead letters into a partition
            channel = connection.channel()
            dlx = f"partq.{STREAM}.dlx"
            assert _refused(lambda: channel.queue_bind(partition, dlx, routing_key="x")) == 403
        # ... nor copying every dead letter into a parking queue (or the parking exchange):
        # it may not bind anything to the dead-letter exchange, whose read right it lacks
        spare = park_queue(STREAM, "nobody")
        assert declare("c-1", spare) == 0
        with _amqp(site, "c-1") as connection:
            dlx, dlq, park = (f"partq.{STREAM}.{name}" for name in ("dlx", "dlq", "park"))
            channel = connection.channel()
            assert _refused(lambda: channel.queue_bind(spare, dlx, routing_key=dlq)) == 403
            channel = connection.channel()
            assert _refused(lambda: channel.exchange_bind(park, dlx, routing_key=dlq)) == 403
            channel = connection.channel()
            assert _refused(lambda: channel.queue_bind(spare, park, routing_key=spare)) == 0
        # ... and what RabbitMQ cannot refuse it, as docs/security.md says: purging the
        # queues it reads (read includes purge), declaring and deleting any parking queue
        # (configure covers both), publishing into the DLQ (the dlx) and parking queues
        # (the parking exchange)
        assert delete("c-1", spare) == 0
        assert purge("c-1", partition) == 0  # every message is handled: nothing is lost here
        forged = _dead_letters(site)  # the one that publish("c-1", dlx, dlq) put there
        assert [h.get("x-partq-error-type") for h in forged] == [None]

        # ... and stream names that would overlap this one's queues are refused
        for name, kind in (("p00001", "partition queue"), ("dlq", "dead-letter queue")):
            refused = site.partq("admin", "stream", "create", f"{STREAM}.{name}",
                                 "--partitions", "1", fails=True)  # fmt: skip
            assert f"stream name '{STREAM}.{name}' overlaps stream '{STREAM}'" in refused
            assert f"partq.{STREAM}.{name} is the name of its {kind}" in refused
        refused = site.partq("root", "security", "roles", f"{STREAM}.dlx", fails=True)
        assert "is the name of its dead-letter exchange" in refused

        # ... and the operator reads, redrives and purges dead letters with its own rights:
        # dead letters of k08 and k09 (as the consumer writes them)
        with _amqp(site, "c-1") as connection:
            channel = connection.channel()
            channel.confirm_delivery()
            for key in ("k08", "k09"):
                headers = {"partq-key": key, "x-partq-error-type": "ValueError"}
                body = json.dumps({"key": key, "seq": 100}).encode()
                properties = pika.BasicProperties(headers=headers, message_id=f"{key}:100")
                dlx, dlq = f"partq.{STREAM}.dlx", f"partq.{STREAM}.dlq"
                channel.basic_publish(dlx, dlq, body, properties)
        listed = site.partq("operator", "dlq", "list", STREAM)
        assert f"dead letters in partq.{STREAM}.dlq: 2" in listed and "k08" in listed
        site.partq("operator", "dlq", "redrive", STREAM, "--dead-letters", "--key", "k08")
        wait_until(lambda: ("k08", 100) in handled(), 30, 0.2, "the dead letter redriven")
        purged = site.partq("operator", "dlq", "purge", STREAM, "--dead-letters", "--yes")
        assert "1 dead letters of every key purged; 0 left" in purged

        # ... and a claim that c-1's credentials put in c-2's name, on a lease of their
        # own (etcd allows it: the claims prefix is shared), is reported by its readers
        victim = min(p for p, owner in state.assignment.items() if owner == "c-2")
        client = connect(site.settings("c-1"))
        try:
            lease = client.lease(60)
            client.put(keys.claim(STREAM, victim), codec.encode_claim("c-2", 1.0),
                       lease=lease)  # fmt: skip
            status = site.partq("operator", "status", STREAM)
            lease.revoke()
        finally:
            client.close()
        assert "claims on a lease no live member holds (1)" in status
        assert f"partition {victim}: names c-2 (lease {c2_lease:x}) but is on lease" in status
    finally:
        for fleet in fleets:
            fleet.close()
        admin.close()

    # And: no password in any output, log or command line
    seen = "\n".join(
        [*site.outputs, *cmdlines, *(p.log.read_text(errors="replace") for f in fleets
                                     for p in f.procs)]
    )  # fmt: skip
    leaked = [user for user, password in site.secret.items() if password in seen]
    assert leaked == []


def test_a_group_runs_on_its_own_roles_and_reaches_no_other_groups_queues(site: Site) -> None:
    # Given the stream's roles and group audit's applied, and the stream (after the tests
    # above, or alone)
    rabbitmqctl = str(site.rabbit.install.program("rabbitmqctl", site.tmp))
    for group in ([f"--member={m}" for m in MEMBERS], ["--group", "audit"]):
        site.partq(
            "root", "security", "roles", STREAM, *group, "--apply", "--passwords",
            str(site.passwords), "--rabbitmqctl", rabbitmqctl, extra=dict(site.rabbit.env),
        )  # fmt: skip
    admin = Registry.connect(site.settings("admin"))
    try:
        try:
            partitions = admin.read_spec(STREAM).partitions
        except StreamNotFound:
            site.partq("admin", "stream", "create", STREAM, "--partitions", str(PARTITIONS))
            partitions = PARTITIONS
        # When the admin creates group audit, and its coordinator and one consumer run on
        # the group's own identities
        assert "created" in site.partq("admin", "group", "create", STREAM, "audit")
        scope = f"{STREAM}~audit"
        record = site.tmp / "audit-records.jsonl"
        fleets = [
            Fleet(scope, site.tmp, site.etcd.endpoint, "", record, env=site.env(who))
            for who in ("audit-coordinator", "audit-consumer")
        ]
        # (and the default group's, so that a resize's fences are handled in both groups)
        fleets += [
            Fleet(STREAM, site.tmp, site.etcd.endpoint, "", site.tmp / "default.jsonl",
                  env=site.env(who))
            for who in ("coordinator", "c-1")
        ]  # fmt: skip
        try:
            fleets[0].coordinator("audit-coordinator", ttl=3)
            fleets[1].consumer("a-1", ttl=3)
            fleets[2].coordinator("default-coordinator", ttl=3)
            fleets[3].consumer("c-1", ttl=3)
            group = Group(admin.client, admin.where, scope)
            wait_until(lambda: balanced(group, partitions, {"a-1"}), 60, 0.2, "audit balanced")
            producer = Registry.connect(site.settings("producer"))

            def publish(rounds: range) -> set[tuple[str, int]]:
                """The producer publishes 20 keys x rounds once, with its own identity."""
                sent = {(f"g{i:02d}", n) for n in rounds for i in range(20)}
                with Producer(STREAM, amqp_url=site.settings("producer").amqp, etcd=producer) as p:
                    for key, n in sorted(sent, key=lambda s: (s[1], s[0])):
                        p.publish(key, json.dumps({"key": key, "seq": n}).encode())
                    p.flush(30)
                return sent

            def handled() -> set[tuple[str, int]]:
                return (
                    {(r["key"], r["seq"]) for r in audit.load(record)} if record.exists() else set()
                )

            # ... and the producer publishes once
            sent = publish(range(5))
            # Then the group handles every message, in order per key
            wait_until(lambda: handled() >= sent, 60, 0.2, "audit handled everything")
            # And when the admin resizes the stream and back, waiting for every group's
            # fences (the group's consumer reads the resize record with its own rights)
            for round_, count in enumerate((partitions * 2, partitions)):
                site.partq("admin", "stream", "resize", STREAM, "-p", str(count), "--wait",
                           "--timeout", "120")  # fmt: skip
                wait_until(lambda c=count: balanced(group, c, {"a-1"}), 60, 0.2, "rebalanced")
                sent |= publish(range(5 + 3 * round_, 8 + 3 * round_))
            wait_until(lambda: handled() >= sent, 60, 0.2, "audit handled the rest")
            assert audit.order_violations(audit.load(record)) == []
            producer.close()
        finally:
            for fleet in fleets:
                fleet.close()
        # And RabbitMQ refuses each group's consumer the other group's queues (403)
        with _amqp(site, "audit-consumer") as connection:
            channel = connection.channel()
            theirs = f"partq.{STREAM}.p00000"
            assert _refused(lambda: channel.basic_consume(theirs, lambda *a: None)) == 403
        with _amqp(site, "audit-operator") as connection:
            channel = connection.channel()
            theirs = f"partq.{STREAM}.dlq"
            assert _refused(lambda: channel.basic_get(theirs)) == 403
        with _amqp(site, "c-1") as connection:
            channel = connection.channel()
            ours = f"partq.{scope}.p00000"
            assert _refused(lambda: channel.basic_consume(ours, lambda *a: None)) == 403
    finally:
        admin.close()


def test_the_admin_role_alone_can_resize_and_the_operator_role_cannot(site: Site) -> None:
    # Given the roles applied, and a stream the admin created (after the test above, or alone)
    site.partq(
        "root", "security", "roles", STREAM, *[f"--member={m}" for m in MEMBERS],
        "--apply", "--passwords", str(site.passwords), "--rabbitmqctl",
        str(site.rabbit.install.program("rabbitmqctl", site.tmp)), extra=dict(site.rabbit.env),
    )  # fmt: skip
    site.partq("admin", "stream", "create", STREAM, "--partitions", str(PARTITIONS))
    # When the operator asks for a resize / Then etcd refuses its record, in one line, and nothing
    # changed
    registry = Registry.connect(site.settings("admin"))
    epoch = registry.read_spec(STREAM).epoch  # the group test above resized it, and back
    registry.close()
    refused = site.partq("operator", "stream", "resize", STREAM, "-p", "8", fails=True)
    assert "permission denied" in refused.lower() and len(refused.strip().splitlines()) == 1
    was = f"{PARTITIONS} partitions" + (f" (epoch {epoch})" if epoch else "") + ", quorum"
    assert f"stream {STREAM}: {was}" in site.partq("admin", "stream", "describe", STREAM)
    # When the admin resizes it / Then the broker steps and the switch are done with its
    # rights alone (declare, unbind, the fences, bind, the spec)
    done = site.partq("admin", "stream", "resize", STREAM, "-p", str(PARTITIONS * 2))
    assert f"producers publish {PARTITIONS * 2} partitions (epoch {epoch + 1})" in done
    assert f"{PARTITIONS * 2} partitions (epoch {epoch + 1})" in site.partq(
        "admin", "stream", "describe", STREAM
    )
    assert all(secret not in out for out in site.outputs for secret in site.secret.values())


def test_roles_are_printed_as_a_script_without_servers() -> None:
    done = subprocess.run(
        [str(PARTQ), "security", "roles", STREAM, "--member", "c-1"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    script = done.stdout
    assert f"etcdctl role add partq-{STREAM}-consumer-c-1" in script
    assert f"readwrite /partq/v1/streams/{STREAM}/members/c-1\n" in script
    assert "rabbitmqctl set_permissions -p / partq-lp-producer '^$' '^(partq\\.lp)$' '^$'" in script
    assert f"partq-{STREAM}-consumer\n" not in script  # members named: no shared role
