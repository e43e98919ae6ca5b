"""A stream's status: leader, members, assignment, claims, queue depth; as data and as HTML.

Keys whose values partq did not write are listed under ``malformed`` (and ignored).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

from coordinator.admin import beyond_line
from coordinator.group import Group
from coordinator.policy import in_motion, paused, unbound_claims
from kernel.amqp import AmqpURL, blocking_connection
from kernel.errors import BrokerUnavailable
from producer.contract import StreamSpec
from producer.registry import Registry
from producer.topology import QueueStats, queue_stats

__all__ = ["beyond_lines", "malformed_lines", "render_html", "snapshot_status"]


def snapshot_status(
    registry: Registry,
    amqp_url: AmqpURL,
    stream: str,
    *,
    depths: Callable[[StreamSpec], list[QueueStats]] | None = None,
) -> dict[str, Any]:
    """The report; queue stats from ``depths`` (a daemon's cached source, whose errors
    propagate) or else from one short-lived connection (depths left out if it fails)."""
    spec = registry.read_spec(stream)
    state = Group(registry.client, registry.where, stream, report=False).snapshot()
    leader = None
    if state.leaders:
        leader = state.leaders[0][1].rsplit("/", 1)[1]
    found: list[QueueStats] = []
    if depths is not None:
        found = depths(spec)
    else:
        try:
            with blocking_connection(amqp_url, name="partq-status") as connection:
                found = queue_stats(connection, spec, beyond=True)
        except BrokerUnavailable:
            pass
    stats = {q.partition: q for q in found if q.partition < spec.partitions}
    beyond = [q for q in found if q.partition >= spec.partitions]
    live = set(state.members)
    owned = {p: o for p, o in state.assignment.items() if o in live}
    moving = sorted(in_motion(owned, state.claims))
    now = time.time()
    rows = []
    for p in range(spec.partitions):
        q = stats.get(p)
        claim = state.claims.get(p)
        owner = owned.get(p)
        if owner is None:
            phase = "unassigned"
        elif claim is None or claim.member != owner:
            phase = "moving"
        elif paused(state.requests, p):
            phase = "paused"
        else:
            phase = "consuming"
        rows.append(
            {
                "partition": p,
                "queue": spec.queue(p),
                "owner": owner,
                "state": phase,
                "claim": claim.member if claim else None,
                "standby": state.standbys.get(p),
                "messages": q.messages if q else None,
                "consumers": q.consumers if q else None,
            }
        )
    members = [
        {
            "id": m.id,
            "weight": m.weight,
            "host": m.host,
            "pid": m.pid,
            "version": m.version,
            "age_s": max(0.0, now - m.started) if m.started else 0.0,
            "owns": sum(1 for o in owned.values() if o == m.id),
        }
        for m in sorted(state.members.values(), key=lambda m: m.id)
    ]
    return {
        "stream": stream,
        "partitions": spec.partitions,
        "queue_type": spec.queue_type,
        "leader": leader,
        "members": members,
        "malformed": [
            {"key": m.key, "kind": m.kind, "error": m.error, "revision": m.revision}
            for m in sorted(state.malformed.values(), key=lambda m: m.key)
        ],
        "assignment": {str(p): o for p, o in sorted(owned.items())},
        "claims": {str(p): c.member for p, c in sorted(state.claims.items())},
        "unbound_claims": [
            {
                "partition": p,
                "member": c.member,
                "lease": f"{c.lease:x}",
                "member_lease": f"{state.members[c.member].lease:x}",
            }
            for p, c in unbound_claims(state.members, state.claims).items()
        ],
        "unassigned": [p for p in range(spec.partitions) if p not in owned],
        "in_motion": moving,
        "paused": sorted(p for p in range(spec.partitions) if paused(state.requests, p)),
        "on_failure": spec.on_failure,
        "parked": [
            {
                "key": r.key_text,
                "partition": r.partition,
                "error": r.error.splitlines()[-1][:200] if r.error else "",
                "member": r.member,
                "at": r.at,
            }
            for r in sorted(state.parked.values(), key=lambda r: (r.at, r.key_id))
        ],
        "rows": rows,
        "beyond_spec": [
            {
                "partition": q.partition,
                "queue": q.queue,
                "messages": q.messages,
                "consumers": q.consumers,
            }
            for q in beyond
        ],
    }


def beyond_lines(report: dict[str, Any]) -> list[str]:
    """One line per partition queue that exists beyond the stream's count."""
    return [
        beyond_line(q["queue"], report["partitions"], q["messages"])
        for q in report.get("beyond_spec", [])
    ]


def render_html(reports: list[dict[str, Any]], refresh_seconds: int = 2) -> str:
    """A self-refreshing page: one partition table per stream."""
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{refresh_seconds}'>",
        "<title>partq status</title><style>",
        "body{font:14px system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}",
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}",
        ".consuming{background:#e6f4ea}.moving{background:#fff4ce}.unassigned{background:#fde2e1}",
        "</style></head><body><h1>partq status</h1>",
    ]
    for r in reports:
        parts.append(
            f"<h2 id='stream-{e(r['stream'])}'>{e(r['stream'])}</h2><p>{r['partitions']} "
            f"partitions, {e(r['queue_type'])} queues; leader: {e(str(r['leader'] or '-'))}; "
            f"unassigned: {len(r['unassigned'])}; moving: {len(r['in_motion'])}</p>"
        )
        parts.extend(f"<p class='beyond'>{e(line)}</p>" for line in beyond_lines(r))
        parts.append(
            "<h3>Members</h3><table><tr><th>member</th><th>weight</th><th>owns</th>"
            "<th>age (s)</th><th>host</th><th>pid</th></tr>"
        )
        for m in r["members"]:
            parts.append(
                f"<tr><td>{e(m['id'])}</td><td>{m['weight']}</td><td>{m['owns']}</td>"
                f"<td>{m['age_s']:.0f}</td><td>{e(m['host'])}</td><td>{m['pid']}</td></tr>"
            )
        parts.append(
            "</table><h3>Partitions</h3><table class='partitions'><tr><th>partition</th>"
            "<th>owner</th><th>state</th><th>claimed by</th><th>standby</th><th>queue</th>"
            "<th>messages</th><th>consumers</th></tr>"
        )
        for row in r["rows"]:
            parts.append(
                f"<tr class='{row['state']}'><td>{row['partition']}</td>"
                f"<td>{e(row['owner'] or '-')}</td><td>{row['state']}</td>"
                f"<td>{e(row['claim'] or '-')}</td><td>{e(row.get('standby') or '-')}</td>"
                f"<td>{e(row['queue'])}</td>"
                f"<td>{'-' if row['messages'] is None else row['messages']}</td>"
                f"<td>{'-' if row['consumers'] is None else row['consumers']}</td></tr>"
            )
        parts.append("</table>")
        if r.get("parked"):
            parts.append(
                f"<h3>Parked keys ({len(r['parked'])}): waiting for <code>partq dlq redrive "
                f"{e(r['stream'])}</code></h3><table class='parked'><tr><th>key</th>"
                "<th>partition</th><th>parked by</th><th>error</th></tr>"
            )
            for k in r["parked"]:
                parts.append(
                    f"<tr><td>{e(k['key'])}</td><td>{k['partition']}</td>"
                    f"<td>{e(k['member'])}</td><td>{e(k['error'])}</td></tr>"
                )
            parts.append("</table>")
        if r.get("malformed"):
            parts.append(
                f"<h3>Malformed keys ({len(r['malformed'])}): ignored as absent</h3>"
                "<table class='malformed'><tr><th>key</th><th>kind</th><th>error</th></tr>"
            )
            for m in r["malformed"]:
                parts.append(
                    f"<tr><td>{e(m['key'])}</td><td>{e(m['kind'])}</td>"
                    f"<td>{e(m['error'])}</td></tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


def malformed_lines(report: dict[str, Any]) -> list[str]:
    """``partq status``'s section on the keys whose values partq did not write, and on
    claims that are not on their member's lease."""
    bad = report.get("malformed", [])
    lines = []
    if bad:
        lines = [f"malformed keys ({len(bad)}): ignored as absent; fix or delete them"]
        lines += [
            f"  {m['key']}  ({m['kind']}, revision {m['revision']}): {m['error']}" for m in bad
        ]
    unbound = report.get("unbound_claims", [])
    if unbound:
        lines.append(
            f"claims not on their member's lease ({len(unbound)}): a restarted member's "
            f"leftovers (gone within its lease TTL) or written with other credentials"
        )
        lines += [
            f"  partition {u['partition']}: names {u['member']} (lease {u['member_lease']}) "
            f"but is on lease {u['lease']}"
            for u in unbound
        ]
    return lines
