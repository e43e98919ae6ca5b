"""Least privilege: the etcd and RabbitMQ rights each partq component needs for one stream.

Pure data (no I/O): :func:`roles` says who may do what; ``partq.coordinator.ops.grants`` applies it
and :func:`script` prints it as ``etcdctl``/``rabbitmqctl`` commands.

=============  ==========================================  ===================================
component      etcd (under /partq/v1/streams/S/)           RabbitMQ (configure / write / read)
=============  ==========================================  ===================================
producer       read ``spec`` and ``resize``                - / exchange ``partq.S`` / -
consumer       read all; write ``members/ID`` (or          parking queues ``partq.S.park.*`` /
               ``members/``), ``claims/``, ``parked/``       ``partq.S.dlx``, ``partq.S.park`` and
               and ``drained/`` (a resize's fences)          parking queues / partition and
                                                           parking queues, ``partq.S.park``
coordinator    read all; write ``assignment/``,            - / - / -   (queue depths are
               ``leader/``, ``requests/`` (clears them),     passive declares: no rights)
               ``/partq/v1/policy/S/``
operator       read all (and the policies); write          - / ``partq.S`` (dlq control
               ``requests/``                                 messages) / ``partq.S.dlq`` (purge)
admin          read and write all of the stream            the stream's exchanges and queues
=============  ==========================================  ===================================

A consumer named with ``--member`` gets its own role whose member key is that one key:
etcd then refuses it another member's key, and a put (or revoke) on another member's lease
(etcd checks every key on the lease; etcd 3.4 skips that check for a put inside a
transaction). The ``claims/`` and ``parked/`` prefixes are shared (any member may be
assigned any partition), so what a consumer's credentials can write there is judged by
the readers: a claim not on its member's lease (``policy.forged_claims``) and a parked
record its partition's holder did not write (``policy.parked_by_holder``) are ignored
and deleted by the leader, and a claim on a lease no live member holds is deleted after
a grace period (``partq.coordinator.leader.forged``); the coordinator's role may therefore delete
under both. :func:`etcd_table` is the exact table in docs/security.md.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from partq.coordinator.store.codec import validate_member_id
from partq.producer.contract import (
    DEFAULT_GROUP,
    GROUP_SEPARATOR,
    dead_letter_exchange,
    dead_letter_queue,
    exchange_name,
    park_exchange,
    park_queue_pattern,
    queue_pattern,
    refuse_overlap,
    role_name,
    split_scope,
)

from partq.kernel import keys

__all__ = ["COMPONENTS", "AmqpRights", "EtcdRight", "Role", "etcd_table", "roles", "script"]

COMPONENTS = ("producer", "consumer", "coordinator", "operator", "admin")
Permission = Literal["read", "write", "readwrite"]
_NOTHING = "^$"


@dataclass(frozen=True, slots=True)
class EtcdRight:
    """One etcd permission: ``key`` itself, or every key under it when ``prefix``."""

    permission: Permission
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class AmqpRights:
    """RabbitMQ's three permission patterns of one user on one vhost."""

    configure: str = _NOTHING
    write: str = _NOTHING
    read: str = _NOTHING


@dataclass(frozen=True, slots=True)
class Role:
    """An etcd role and a RabbitMQ user of the same name, for one component of one stream."""

    name: str
    component: str
    stream: str
    etcd: tuple[EtcdRight, ...]
    amqp: AmqpRights
    member: str | None = None


def _either(*patterns: str) -> str:
    """One pattern matching what any of the anchored ``patterns`` matches."""
    return "^(" + "|".join(p.removeprefix("^").removesuffix("$") for p in patterns) + ")$"


def _exactly(*names: str) -> str:
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def roles(scope: str, members: Iterable[str] = ()) -> list[Role]:
    """The roles of a stream's group (``scope``: the stream for its default group, else
    ``STREAM~GROUP``): one per component, and one per named consumer member. A group other
    than the default has no producer or admin role of its own: the stream's serve it.

    With ``members`` the shared consumer role is left out: each member gets
    ``partq-S-consumer-ID``, which may write only its own member key.
    """
    stream, group = split_scope(scope)
    refuse_overlap(stream)  # another stream's rights would reach this one's queues
    named = sorted(set(members))
    for member in named:
        validate_member_id(member)
    base = keys.stream_prefix(scope)
    read_all = EtcdRight("read", base, prefix=True)
    # a group's own keys, and the stream's that every group reads (the default group's
    # prefix holds them; another group may not read the default group's keys)
    stream_keys = [] if group == DEFAULT_GROUP else [
        EtcdRight("read", keys.spec(scope)), EtcdRight("read", keys.resize(scope)),
        EtcdRight("read", keys.group_record(stream, group))]  # fmt: skip
    queues = queue_pattern(scope)
    parking = park_queue_pattern(scope)  # declared, bound, read and deleted by consumers
    dlx = _exactly(dead_letter_exchange(scope))
    park = _exactly(park_exchange(scope))  # parking queues are bound to it: binding reads it
    consumer_amqp = AmqpRights(
        configure=parking,
        write=_either(dlx, park, parking),
        # no read on the dlx: it could bind a queue under the DLQ's routing key
        read=_either(queues, parking, park),
    )
    claims = EtcdRight("readwrite", keys.claims(scope), prefix=True)
    parked = EtcdRight("readwrite", keys.parked_keys(scope), prefix=True)
    drained = EtcdRight("readwrite", keys.drained_all(scope), prefix=True)  # resize fences
    read_loads = EtcdRight("read", keys.loads(scope), prefix=True)  # load reports
    read_policies = EtcdRight("read", keys.policies(scope), prefix=True)  # coordinators'

    def role(component: str, etcd: Sequence[EtcdRight], amqp: AmqpRights) -> Role:
        return Role(role_name(scope, component), component, stream, tuple(etcd), amqp)

    found = [
        role("coordinator", [read_all, *stream_keys, read_loads,
             EtcdRight("readwrite", keys.assignments(scope), prefix=True),
             EtcdRight("readwrite", keys.leader_prefix(scope), prefix=True),
             EtcdRight("readwrite", keys.standbys(scope), prefix=True),
             EtcdRight("readwrite", keys.requests(scope), prefix=True),
             EtcdRight("readwrite", keys.policies(scope), prefix=True),
             claims, parked], AmqpRights()),  # deletes forged ones: partq.coordinator.leader.forged
        role("operator", [read_all, *stream_keys, read_loads, read_policies,
                          EtcdRight("readwrite", keys.requests(scope), prefix=True)],
             AmqpRights(write=_exactly(exchange_name(scope)),  # dlq requests, redriven copies
                        read=_exactly(dead_letter_queue(scope)))),  # dlq list/redrive/purge
    ]  # fmt: skip
    if group == DEFAULT_GROUP:  # the stream's own: its groups' too
        found += [
            role("producer", [EtcdRight("read", keys.spec(stream)),  # and the resize record:
                              EtcdRight("read", keys.resize(stream))],  # a returned message
                 AmqpRights(write=_exactly(exchange_name(stream)))),
            role("admin", [EtcdRight("readwrite", base, prefix=True),
                           EtcdRight("readwrite", keys.group_scopes(stream), prefix=True),
                           EtcdRight("readwrite", keys.loads(stream), prefix=True),
                           EtcdRight("readwrite", keys.policies(stream), prefix=True)],
                 AmqpRights(*[_admin_pattern(stream, queues)] * 3)),
        ]  # fmt: skip
    if not named:
        members_right = EtcdRight("readwrite", keys.members(scope), prefix=True)
        loads_right = EtcdRight("readwrite", keys.loads(scope), prefix=True)
        found.append(
            role(
                "consumer",
                [read_all, *stream_keys, members_right, claims, parked, drained, loads_right],
                consumer_amqp,
            )
        )
    for member in named:
        own = EtcdRight("readwrite", keys.member(scope, member))
        own_load = EtcdRight("readwrite", keys.load(scope, member))
        found.append(
            Role(
                role_name(scope, "consumer", member),
                "consumer",
                stream,
                (read_all, *stream_keys, own, claims, parked, drained, own_load),
                consumer_amqp,
                member,
            )
        )
    return sorted(found, key=lambda r: (COMPONENTS.index(r.component), r.name))


def _admin_pattern(stream: str, queues: str) -> str:
    """The stream's exchange, dead-letter exchange and queue, parking exchange, its partition
    and parking queues (``stream delete`` deletes the parking queues)."""
    fixed = _exactly(
        exchange_name(stream),
        dead_letter_exchange(stream),
        dead_letter_queue(stream),
        park_exchange(stream),
    )
    groups = (  # every group's queues and exchanges (group delete, stream delete)
        rf"^{re.escape(f'partq.{stream}')}{GROUP_SEPARATOR}[a-z0-9][a-z0-9_.-]*"
        r"\.(p\d{5}|dlq|dlx|park|park\.[0-9a-f]{16})$"
    )
    routes = rf"^{re.escape(f'partq.{stream}')}{GROUP_SEPARATOR}p\d{{5}}$"  # partition exchanges
    return f"{fixed}|{queues}|{park_queue_pattern(stream)}|{groups}|{routes}"


def amqp_table(stream: str = "orders") -> str:
    """The RabbitMQ permissions of each component as the markdown table in docs/security.md
    (a test keeps the two equal)."""

    def cell(pattern: str) -> str:
        return "\u2013" if pattern == _NOTHING else "`" + pattern.replace("|", "\\|") + "`"

    lines = ["| component | configure | write | read |", "|---|---|---|---|"]
    for r in roles(stream):
        rights = r.amqp
        row = [r.component, cell(rights.configure), cell(rights.write), cell(rights.read)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def script(found: Sequence[Role], *, vhost: str = "/", secrets: str = "$SECRETS") -> str:
    """Shell commands that create the roles and users (passwords read from files).

    Each user's password is read from ``<secrets>/<user name>`` (for a certificate
    identity, the etcd user is created ``--no-password`` instead and its name is the CN).
    """
    lines = [
        "#!/bin/sh",
        f"# partq least-privilege roles for stream {found[0].stream!r}" if found else "# no roles",
        "# Run as etcd's root user (ETCDCTL_* set) and where rabbitmqctl reaches the node.",
        f'# Passwords are read from files: SECRETS="{secrets}"/<user name>.',
        "set -eu",
        "",
        "# -- etcd ----------------------------------------------------------------------",
    ]
    for r in found:
        q = shlex.quote(r.name)
        lines.append(f"etcdctl role add {q}")
        for right in r.etcd:
            prefix = " --prefix=true" if right.prefix else ""
            lines.append(
                f"etcdctl role grant-permission {q}{prefix} {right.permission} "
                f"{shlex.quote(right.key)}"
            )
        lines.append(
            f'etcdctl user add {q} --interactive=false < "{secrets}/{r.name}"'
            "   # or --no-password for a client certificate with CN=" + r.name
        )
        lines.append(f"etcdctl user grant-role {q} {q}")
    lines += [
        "",
        "# -- RabbitMQ ------------------------------------------------------------------",
        "# A consumer's user may declare any parking queue of its stream: a vhost per stream",
        "# with a queue limit bounds them (docs/security.md, Least privilege on RabbitMQ):",
        f"# rabbitmqctl set_vhost_limits -p {shlex.quote(vhost)} '{{\"max-queues\": N}}'",
    ]
    for r in found:
        q = shlex.quote(r.name)
        lines.append(f'rabbitmqctl add_user {q} < "{secrets}/{r.name}"   # stdin: not in argv')
        lines.append(
            f"rabbitmqctl set_permissions -p {shlex.quote(vhost)} {q} "
            f"{shlex.quote(r.amqp.configure)} {shlex.quote(r.amqp.write)} "
            f"{shlex.quote(r.amqp.read)}"
        )
    return "\n".join(lines) + "\n"


def etcd_table(found: Sequence[Role]) -> str:
    """The etcd rights of ``found`` as a Markdown table, one row per right (docs/security.md
    holds it for stream ``S``; a test checks the two agree)."""
    lines = ["| role | permission | key |", "|---|---|---|"]
    for r in found:
        for right in r.etcd:
            key = f"`{right.key}`" + (" and every key under it" if right.prefix else "")
            lines.append(f"| `{r.name}` | {right.permission} | {key} |")
    return "\n".join(lines) + "\n"
