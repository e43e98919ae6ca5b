"""Least privilege: the etcd and RabbitMQ rights each partq component needs for one stream.

Pure data (no I/O): :func:`roles` says who may do what; ``coordinator.grants`` applies it
and :func:`script` prints it as ``etcdctl``/``rabbitmqctl`` commands.

=============  ==========================================  ===================================
component      etcd (under /partq/v1/streams/S/)           RabbitMQ (configure / write / read)
=============  ==========================================  ===================================
producer       read ``spec``                               - / exchange ``partq.S`` / -
consumer       read all; write ``members/ID`` (or          parking queues ``partq.S.park.*`` /
               ``members/``), ``claims/`` and ``parked/``    ``partq.S.dlx`` and parking queues /
                                                             partition and parking queues, dlx
coordinator    read all; write ``assignment/``,            - / - / -   (queue depths are
               ``leader/``, ``requests/`` (clears them),     passive declares: no rights)
               ``/partq/v1/policy/S/``
operator       read all (and the policies); write          - / ``partq.S`` (dlq control
               ``requests/``                                 messages) / ``partq.S.dlq`` (purge)
admin          read and write all of the stream            the stream's exchanges and queues
=============  ==========================================  ===================================

A consumer named with ``--member`` gets its own role whose member key is that one key:
etcd then refuses it another member's key, and (etcd checks a put's lease against every
key already on it) another member's lease, so it cannot pose as another member. The
``claims/`` prefix is shared by design (any member may be assigned any partition): a
consumer's credentials can write or delete any claim of its stream. Readers check that a
claim sits on its member's lease (``policy.unbound_claims``; ``partq status``, the
``partq_claims_unbound`` gauge); the broker's single-active-consumer queue still lets
only one consumer take from a partition whatever etcd says.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from coordinator.codec import validate_member_id
from kernel import keys
from producer.contract import (
    dead_letter_exchange,
    dead_letter_queue,
    exchange_name,
    park_queue_pattern,
    queue_pattern,
    validate_stream_name,
)

__all__ = ["COMPONENTS", "AmqpRights", "EtcdRight", "Role", "roles", "script"]

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


def roles(stream: str, members: Iterable[str] = ()) -> list[Role]:
    """The roles of ``stream``: one per component, and one per named consumer member.

    With ``members`` the shared consumer role is left out: each member gets
    ``partq-S-consumer-ID``, which may write only its own member key.
    """
    validate_stream_name(stream)
    named = sorted(set(members))
    for member in named:
        validate_member_id(member)
    base = keys.stream_prefix(stream)
    read_all = EtcdRight("read", base, prefix=True)
    queues = queue_pattern(stream)
    parking = park_queue_pattern(stream)  # declared, bound, read and deleted by consumers
    dlx = _exactly(dead_letter_exchange(stream))
    consumer_amqp = AmqpRights(
        configure=parking,
        write=_either(dlx, parking),
        read=_either(queues, parking, dlx),  # binding to the dlx reads it
    )
    claims = EtcdRight("readwrite", keys.claims(stream), prefix=True)
    parked = EtcdRight("readwrite", keys.parked_keys(stream), prefix=True)
    read_loads = EtcdRight("read", keys.loads(stream), prefix=True)  # load reports
    read_policies = EtcdRight("read", keys.policies(stream), prefix=True)  # coordinators'

    def role(component: str, etcd: Sequence[EtcdRight], amqp: AmqpRights) -> Role:
        return Role(f"partq-{stream}-{component}", component, stream, tuple(etcd), amqp)

    found = [
        role("producer", [EtcdRight("read", keys.spec(stream))],
             AmqpRights(write=_exactly(exchange_name(stream)))),
        role("coordinator", [read_all, read_loads,
             EtcdRight("readwrite", keys.assignments(stream), prefix=True),
             EtcdRight("readwrite", keys.leader_prefix(stream), prefix=True),
             EtcdRight("readwrite", keys.standbys(stream), prefix=True),
             EtcdRight("readwrite", keys.requests(stream), prefix=True),
             EtcdRight("readwrite", keys.policies(stream), prefix=True)], AmqpRights()),
        role("operator", [read_all, read_loads, read_policies,
                          EtcdRight("readwrite", keys.requests(stream), prefix=True)],
             AmqpRights(write=_exactly(exchange_name(stream)),  # dlq requests, redriven copies
                        read=_exactly(dead_letter_queue(stream)))),  # dlq list/redrive/purge
        role("admin", [EtcdRight("readwrite", base, prefix=True),
                       EtcdRight("readwrite", keys.loads(stream), prefix=True),
                       EtcdRight("readwrite", keys.policies(stream), prefix=True)],
             AmqpRights(*[_admin_pattern(stream, queues)] * 3)),
    ]  # fmt: skip
    if not named:
        members_right = EtcdRight("readwrite", keys.members(stream), prefix=True)
        loads_right = EtcdRight("readwrite", keys.loads(stream), prefix=True)
        found.append(
            role("consumer", [read_all, members_right, claims, parked, loads_right], consumer_amqp)
        )
    for member in named:
        own = EtcdRight("readwrite", keys.member(stream, member))
        own_load = EtcdRight("readwrite", keys.load(stream, member))
        found.append(
            Role(
                f"partq-{stream}-consumer-{member}",
                "consumer",
                stream,
                (read_all, own, claims, parked, own_load),
                consumer_amqp,
                member,
            )
        )
    return sorted(found, key=lambda r: (COMPONENTS.index(r.component), r.name))


def _admin_pattern(stream: str, queues: str) -> str:
    """The stream's exchange, dead-letter exchange and queue, its partition and parking queues
    (``stream delete`` deletes the parking queues)."""
    fixed = _exactly(exchange_name(stream), dead_letter_exchange(stream), dead_letter_queue(stream))
    return f"{fixed}|{queues}|{park_queue_pattern(stream)}"


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
