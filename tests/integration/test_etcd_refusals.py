"""A refusal from etcd ends a consumer with one line; it is not retried forever.

Given a private etcd on loopback (TLS, auth: python3-etcd3 sends its token only over
TLS) and the machine's RabbitMQ, a stream created by root, and a consumer whose etcd
role may read the stream but not write its member key: ``partq consume`` exits
non-zero within a bound, and its one error line names the key and the permission to
grant (partq.kernel.etcd's hint), instead of logging "cannot join; retrying" forever.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.integration.groups.harness import HANDLERS, PARTQ, ROOT, Fleet, Proc
from tests.pki import loopback_server_tls
from tests.polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT_PASSWORD = "root-secret"
MEMBER = "c-1"
USER = "reader"
EXIT_WITHIN = 60.0  # seconds: joining waits for RabbitMQ first, then fails at once


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEtcd, Path]]:
    """A TLS etcd with auth enabled and a root user; its CA file."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("refusals-pki")
    tls = loopback_server_tls(d)
    server = LocalEtcd(tls=tls)
    try:
        server.start()
    except Exception as e:
        pytest.skip(f"etcd would not start: {e}")
    try:
        server.enable_auth(ROOT_PASSWORD)
        yield server, tls.ca
    finally:
        server.stop()


def _consume(fleet: Fleet) -> Proc:
    """``partq consume`` of fleet's stream as member c-1, its output in ``c-1.log``."""
    log = fleet.tmp / f"{MEMBER}.log"
    args = ["consume", fleet.stream, "--handler", f"{HANDLERS}:record", "--member-id", MEMBER,
            "--ttl", "2", "--http-port", "0"]  # fmt: skip
    env = {**os.environ, "PARTQ_ETCD_ENDPOINTS": fleet.etcd, "PARTQ_AMQP_URL": fleet.amqp,
           "PYTHONPATH": str(ROOT), "PARTQ_RECORD": str(fleet.record), **fleet.env}  # fmt: skip
    with open(log, "ab") as out:
        popen = subprocess.Popen([str(PARTQ), *args], stdout=out, stderr=out, env=env, cwd=ROOT)
    fleet.procs.append(Proc(MEMBER, popen, log))  # ended by PID in fleet.close()
    return fleet.procs[-1]


def test_a_consumer_refused_its_member_key_exits_with_one_line(
    etcd: tuple[LocalEtcd, Path], rabbitmq: str, stream_name: str, tmp_path: Path
) -> None:
    server, ca = etcd
    root = Settings.load(etcd_endpoints=server.endpoint, etcd_ca=ca, etcd_user="root",
                         etcd_password=ROOT_PASSWORD, amqp_url=rabbitmq)  # fmt: skip
    # Given a stream, and a user whose role reads it and writes its claims, not its member key
    registry = Registry.connect(root)
    admin.create_stream(registry, rabbitmq, StreamSpec(stream_name, 2))
    as_root = {"user": f"root:{ROOT_PASSWORD}"}
    server.etcdctl("role", "add", USER, **as_root)
    server.etcdctl("role", "grant-permission", USER, "--prefix=true", "read",
                   keys.stream_prefix(stream_name), **as_root)  # fmt: skip
    server.etcdctl("role", "grant-permission", USER, "--prefix=true", "readwrite",
                   keys.claims(stream_name), **as_root)  # fmt: skip
    server.etcdctl("user", "add", f"{USER}:{USER}-secret", **as_root)
    server.etcdctl("user", "grant-role", USER, USER, **as_root)
    (tmp_path / "password").write_text(f"{USER}-secret\n")
    fleet = Fleet(stream_name, tmp_path, server.endpoint, rabbitmq, tmp_path / "rec.jsonl")
    fleet.env = {
        "PARTQ_ETCD_CA": str(ca),
        "PARTQ_ETCD_USER": USER,
        "PARTQ_ETCD_PASSWORD_FILE": str(tmp_path / "password"),
    }
    try:
        # When it runs as a consumer of the stream (as deployed: without --debug)
        consumer = _consume(fleet)
        # Then it exits non-zero within the bound, not retrying the refusal
        wait_until(lambda: not consumer.alive(), EXIT_WITHIN, 0.2, "the consumer exits")
        assert consumer.popen.returncode not in (0, None), consumer.tail()
        # And its last line, its one error line, names the member key and what to grant
        output = consumer.tail(400).splitlines()
        errors = [line for line in output if "error" in line.lower()]
        assert errors == output[-1:], consumer.tail()
        (line,) = errors
        member_key = keys.member(stream_name, MEMBER)
        assert "permission denied" in line and member_key in line, line
        assert f"grant its role readwrite on {member_key}" in line, line
        assert "retrying" not in consumer.tail(400), "a refusal must not be retried"
    finally:
        fleet.close()
        with contextlib.suppress(Exception):
            admin.delete(registry, rabbitmq, stream_name)
        registry.close()
