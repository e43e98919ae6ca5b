"""Applies :mod:`partq.coordinator.ops.rights` to etcd (its Auth API) and RabbitMQ
(``rabbitmqctl``).

Idempotent: a role, user or permission that exists is left as it is (a user's password is
never changed). Passwords come from files named after the users, never from argv.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import etcd3.utils
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2
from partq.coordinator.ops.rights import Role

from partq.kernel.errors import UsageError
from partq.kernel.etcd import CallFailed

__all__ = ["apply_etcd", "apply_rabbitmq", "read_password"]

log = logging.getLogger("partq.security")
_PERMISSION = {
    "read": auth_pb2.Permission.READ,
    "write": auth_pb2.Permission.WRITE,
    "readwrite": auth_pb2.Permission.READWRITE,
}


def read_password(directory: Path | None, user: str) -> str | None:
    """The password in ``directory/user`` (one trailing newline stripped), or None."""
    if directory is None:
        return None
    path = directory / user
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UsageError(f"cannot read the password file {path}: {e.strerror}") from None
    password = text[:-1] if text.endswith("\n") else text
    if not password:
        raise UsageError(f"the password file {path} is empty")
    return password


def _exists(error: CallFailed) -> bool:
    return "already exists" in error.details or "already granted" in error.details


def apply_etcd(
    client: Any, found: Sequence[Role], passwords: Path | None, *, no_password: bool
) -> list[str]:
    """Create the roles, their permissions and a user per role; what was done, one per line."""
    done: list[str] = []

    def call(name: str, request: Any, what: str) -> None:
        try:
            client.auth_rpc(name, request, "manage users and roles (needs etcd's root role)")
        except CallFailed as e:
            if not _exists(e):
                raise
            return
        done.append(what)

    for role in found:
        call("RoleAdd", etcdrpc.AuthRoleAddRequest(name=role.name), f"etcd role {role.name}")
        for right in role.etcd:
            key = right.key.encode()
            end = etcd3.utils.prefix_range_end(key) if right.prefix else b""
            permission = auth_pb2.Permission(
                permType=_PERMISSION[right.permission], key=key, range_end=end
            )
            request = etcdrpc.AuthRoleGrantPermissionRequest(name=role.name, perm=permission)
            star = "*" if right.prefix else ""
            call("RoleGrantPermission", request, f"  {right.permission} {right.key}{star}")
        password = read_password(passwords, role.name)
        if password is None and not no_password:
            where = f"{passwords}/{role.name}" if passwords else "--passwords DIR/" + role.name
            raise UsageError(
                f"no password for etcd user {role.name}: write it to {where}, or pass "
                f"--no-password for users that log in with a client certificate (CN={role.name})"
            )
        if password is not None:
            user = etcdrpc.AuthUserAddRequest(name=role.name, password=password)
            call("UserAdd", user, f"etcd user {role.name}")
        else:  # python3-etcd3's protocol predates UserAddOptions(no_password): etcdctl can
            _require_user(client, role.name)
        grant = etcdrpc.AuthUserGrantRoleRequest(user=role.name, role=role.name)
        call("UserGrantRole", grant, f"  granted role {role.name}")
    return done


def _require_user(client: Any, name: str) -> None:
    try:
        client.auth_rpc("UserGet", etcdrpc.AuthUserGetRequest(name=name), "read users")
    except CallFailed as e:
        if "not found" not in e.details:
            raise
        raise UsageError(
            f"etcd user {name} does not exist: create it for its client certificate with "
            f"`etcdctl user add {name} --no-password` (CN={name}), then run this again"
        ) from None


Runner = Callable[[Sequence[str], str | None], subprocess.CompletedProcess[str]]


def _run(rabbitmqctl: str) -> Runner:
    def run(args: Sequence[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [rabbitmqctl, *args],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except FileNotFoundError:
            raise UsageError(
                f"{rabbitmqctl} not found: pass --rabbitmqctl PATH, or apply the printed "
                f"commands where rabbitmqctl reaches the node"
            ) from None

    return run


def apply_rabbitmq(
    found: Sequence[Role],
    passwords: Path | None,
    *,
    vhost: str = "/",
    rabbitmqctl: str = "rabbitmqctl",
    run: Runner | None = None,
) -> list[str]:
    """Create a RabbitMQ user per role (if it has a password file) and set its permissions."""
    run = run or _run(rabbitmqctl)
    done: list[str] = []
    for role in found:
        password = read_password(passwords, role.name)
        if password is not None:
            added = run(["add_user", role.name], password + "\n")  # stdin: never in argv
            if added.returncode == 0:
                done.append(f"RabbitMQ user {role.name}")
            elif "already exists" not in added.stdout + added.stderr:
                raise UsageError(f"rabbitmqctl add_user {role.name} failed: {_last(added)}")
        rights = role.amqp
        args = ["set_permissions", "-p", vhost, role.name, rights.configure, rights.write]
        result = run([*args, rights.read], None)
        if result.returncode != 0:
            raise UsageError(
                f"rabbitmqctl set_permissions for {role.name} failed: {_last(result)} "
                f"(does the user exist? write its password to --passwords DIR/{role.name})"
            )
        done.append(
            f"RabbitMQ {role.name} on {vhost}: configure {rights.configure} "
            f"write {rights.write} read {rights.read}"
        )
    return done


def _last(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {result.returncode}"
