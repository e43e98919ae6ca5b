"""A stream's status: leader, members, assignment, claims, queue depth; as data and as HTML.

Keys whose values partq did not write are listed under ``malformed`` (and ignored).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from partq.coordinator.leader import resize
from partq.coordinator.leader.policy import draining, in_motion, paused, unbound_claims
from partq.coordinator.ops.admin import beyond_line
from partq.coordinator.ops.charts import charts_html, member_hue
from partq.coordinator.store.codec import LoadReport
from partq.coordinator.store.group import Claim, Group, GroupState
from partq.producer.contract import StreamSpec
from partq.producer.queue_probes import QueueStats, queue_stats
from partq.producer.registry import Registry

from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import BrokerRefused, BrokerUnavailable, PartqError

__all__ = ["beyond_lines", "malformed_lines", "per_second", "render_html", "snapshot_status"]


def snapshot_status(
    registry: Registry,
    amqp_url: AmqpURL,
    stream: str,
    *,
    depths: Callable[[StreamSpec], list[QueueStats]] | None = None,
) -> dict[str, Any]:
    """The report; queue stats from ``depths`` (a daemon's cached source, whose errors
    propagate) or else from one short-lived connection (depths left out if RabbitMQ cannot
    be reached; raised if it refused the login or a queue)."""
    spec = registry.read_spec(stream)
    group = Group(registry.client, registry.where, stream, report=False)
    state = group.snapshot()
    now = time.time()
    handled = _handled(group, set(state.members), now)
    found: list[QueueStats] = []
    if depths is not None:
        found = depths(spec)
    else:
        try:
            with blocking_connection(amqp_url, name="partq-status") as connection:
                found = queue_stats(connection, spec, beyond=True)
        except BrokerRefused:
            raise  # not an outage: the user has to fix the login or the rights
        except BrokerUnavailable:
            pass
    return _report(spec, state, handled, found, now)


def _report(
    spec: StreamSpec,
    state: GroupState,
    handled: Mapping[str, LoadReport],
    found: list[QueueStats],
    now: float,
) -> dict[str, Any]:
    """The report of what was read (no I/O)."""
    live = set(state.members)
    owned = {p: o for p, o in state.assignment.items() if o in live}
    return {
        "stream": spec.name,
        "group": spec.group,
        "partitions": spec.partitions,
        "queue_type": spec.queue_type,
        "leader": state.leaders[0][1] if state.leaders else None,
        "members": _members(state, owned, handled, now),
        "malformed": [
            {"key": m.key, "kind": m.kind, "error": m.error, "revision": m.revision}
            for m in sorted(state.malformed.values(), key=lambda m: m.key)
        ],
        "assignment": {str(p): o for p, o in sorted(owned.items())},
        "claims": {str(p): c.member for p, c in sorted(state.claims.items())},
        "unbound_claims": _claims(state, unbound_claims(state.members, state.claims)),
        "forged_claims": _claims(state, state.forged),
        "unassigned": [p for p in range(spec.partitions) if p not in owned],
        "in_motion": sorted(in_motion(owned, state.claims)),
        "paused": sorted(p for p in range(spec.partitions) if paused(state.requests, p)),
        "on_failure": spec.on_failure,
        "parked": [
            {
                "key": r.key_shown,  # all of it: partq dlq list
                "key_id": r.key_id,
                "queue": spec.park_queue(r.key),
                "partition": r.partition,
                "error": r.error.splitlines()[-1][:200] if r.error else "",
                "member": r.member,
                "at": r.at,
            }
            for r in sorted(state.parked.values(), key=lambda r: (r.at, r.key_id))
        ],
        "rows": _rows(spec, state, owned, handled, found),
        "resize": resize.summary(state.resize) if state.resize is not None else None,
        "beyond_spec": [
            {
                "partition": q.partition,
                "queue": q.queue,
                "messages": q.messages,
                "consumers": q.consumers,
            }
            for q in found
            if q.partition >= spec.partitions
        ],
    }


def _rows(
    spec: StreamSpec,
    state: GroupState,
    owned: Mapping[int, str],
    handled: Mapping[str, LoadReport],
    found: list[QueueStats],
) -> list[dict[str, Any]]:
    """One row per partition: its owner, state, claim, standby, queue and handling rate."""
    stats = {q.partition: q for q in found if q.partition < spec.partitions}
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
                "handled_per_s": sum(r.rates.get(p, 0.0) for r in handled.values())
                if handled
                else None,
                "in_flight": _in_flight(handled, owner, p),
            }
        )
    return rows


def _members(
    state: GroupState, owned: Mapping[int, str], handled: Mapping[str, LoadReport], now: float
) -> list[dict[str, Any]]:
    drained = draining(state.requests)
    return [
        {
            "id": m.id,
            "weight": m.weight,
            "host": m.host,
            "pid": m.pid,
            "version": m.version,
            "age_s": max(0.0, now - m.started) if m.started else 0.0,
            "owns": sum(1 for o in owned.values() if o == m.id),
            "draining": m.id in drained,
            "leaving": m.leaving,
            "handled_per_s": handled[m.id].total if m.id in handled else None,
            "parking_stalled": list(handled[m.id].parking_stalled) if m.id in handled else [],
            "in_flight": handled[m.id].in_flight if m.id in handled else None,
            **_concurrency(handled.get(m.id)),
        }
        for m in sorted(state.members.values(), key=lambda m: m.id)
    ]


def _concurrency(report: LoadReport | None) -> dict[str, Any]:
    """A member's --concurrency and its longest-waiting key, from its load report (None:
    no fresh report, or one from an older partq)."""
    c = report.concurrency if report is not None else None
    return {
        "concurrency": None if c is None else c.setting,
        "waiting_key": None if c is None else c.waiting_key,
        "waiting_s": None if c is None or c.waiting_key is None else c.waiting_seconds,
    }


def _in_flight(handled: Mapping[str, LoadReport], owner: str | None, p: int) -> int | None:
    """Messages of partition ``p`` in its owner's handlers, as the owner last reported."""
    report = handled.get(owner) if owner is not None else None
    if report is None or report.concurrency is None:
        return None
    return report.concurrency.in_flight.get(p)


def _handled(group: Group, members: set[str], now: float) -> dict[str, LoadReport]:
    """The live members' fresh load reports (what each handled per partition lately);
    none if etcd refuses them (an older role without the right to read them)."""
    try:
        reports = group.loads()
    except PartqError:
        return {}
    return {m: r for m, r in reports.items() if m in members and r.fresh(now)}


def per_second(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0f}/s"


def beyond_lines(report: dict[str, Any]) -> list[str]:
    """The running resize (:func:`partq.coordinator.leader.resize.summary_lines`), then one line per
    partition queue that exists beyond the stream's count: a shrink's retired queue, or
    one the spec does not account for."""
    doc = report.get("resize")
    lines = resize.summary_lines(doc, report["stream"]) if doc else []
    retiring = set(doc["retiring"]) if doc else set()
    for q in report.get("beyond_spec", []):
        if q["partition"] in retiring:
            lines.append(
                f"queue {q['queue']} is retired by the resize: {q['messages']} messages, "
                f"{q['consumers']} consumers (deleted once drained and empty)"
            )
        else:
            lines.append(beyond_line(q["queue"], report["partitions"], q["messages"]))
    return lines


def owner_colour(member: str) -> str:
    """A stable, light colour per member (the same on every page and coordinator)."""
    return f"hsl({member_hue(member)},62%,78%)"


_CSS = (
    "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
    ".consuming{background:#e6f4ea}.moving{background:#fff4ce}.unassigned{background:#fde2e1}"
    ".grid{display:flex;flex-wrap:wrap;gap:4px;margin:.5em 0 1em}"
    ".cell{width:92px;height:54px;border:2px solid #8889;border-radius:4px;padding:2px 4px;"
    "box-sizing:border-box;font-size:12px;line-height:16px;overflow:hidden}"
    ".cell b{font-size:13px}.cell .depth{float:right}"
    ".cell.moving{border:2px dashed #c60}"
    ".cell.paused{background-image:repeating-linear-gradient(45deg,#0000 0 6px,#fff8 6px 12px)}"
    ".cell.unassigned{background:#ddd!important;border-color:#c00}"
    ".swatch{display:inline-block;width:12px;height:12px;border:1px solid #888;"
    "margin-right:4px;vertical-align:middle}"
    ".legend span.m{margin-right:1.2em;white-space:nowrap}"
    ".summary{display:flex;gap:2em;flex-wrap:wrap}.summary div{white-space:nowrap}"
    ".charts{display:flex;flex-wrap:wrap;gap:.5em 1.5em;margin:.5em 0 1em}"
    "figure.chart{margin:0}figure.chart figcaption{font-size:12px;color:#444}"
    ".chart-legend{font-size:11px;max-width:440px}"
)


def _rate(rate: float | None) -> str:
    if rate is None:
        return ""
    return f"{rate:+.0f}/s"


def _handled_cell(rate: float | None) -> str:
    return "" if rate is None else f"✓{rate:.0f}/s"


def _when(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at))


def render_html(reports: list[dict[str, Any]], refresh_seconds: int = 2) -> str:
    """A self-refreshing console, no script and nothing fetched from elsewhere: per stream a
    partition grid coloured by owner (depth, its change per second, and what its owner
    handled per second), the members with their colour and throughput (their load reports),
    recent rebalances and handoffs with their claim gaps, parked keys and
    dead letters; then the detailed tables."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{refresh_seconds}'>",
        f"<title>partq status</title><style>{_CSS}</style></head><body><h1>partq status</h1>",
    ]
    for r in reports:
        parts.extend(_stream_html(r))
    parts.append(f"<p><small>refreshed every {refresh_seconds}s; times UTC</small></p>")
    parts.append("</body></html>")
    return "".join(parts)


def _stream_html(r: dict[str, Any]) -> list[str]:
    parts = _summary_html(r) + _grid_html(r)
    if "trends" in r:  # the coordinator's page: what it sampled lately
        parts.append(charts_html(r["trends"], r["trends_now"], r["trends_window"]))
    for section in (_timeline_html, _parked_html, _members_html, _partitions_html):
        parts += section(r)
    return parts + _malformed_html(r)


def _summary_html(r: dict[str, Any]) -> list[str]:
    """The counts, the notes on queues beyond the spec, the legend of members."""
    e = html.escape
    stream = e(r["stream"])
    dead = r.get("dead_letters")
    parts = [
        f"<h2 id='stream-{stream}'>{stream}</h2>",
        "<div class='summary'>"
        f"<div>{r['partitions']} partitions, {e(r['queue_type'])} queues</div>"
        f"<div>leader: {e(str(r['leader'] or '-'))}</div>"
        f"<div>members: {len(r['members'])}</div>"
        f"<div>unassigned: {len(r['unassigned'])}</div>"
        f"<div>moving: {len(r['in_motion'])}</div>"
        f"<div>paused: {len(r.get('paused', []))}</div>"
        f"<div>parked keys: {len(r.get('parked', []))}</div>"
        f"<div>dead letters: {'-' if dead is None else dead}</div>"
        f"<div>ready messages: {sum(row['messages'] or 0 for row in r['rows'])}</div>"
        "</div>",
    ]
    parts.extend(f"<p class='beyond'>{e(line)}</p>" for line in beyond_lines(r))
    parts.append("<div class='legend'>")
    for m in r["members"]:
        parts.append(
            f"<span class='m'><span class='swatch' style='background:{owner_colour(m['id'])}'>"
            f"</span>{e(m['id'])} ({m['owns']}, {per_second(m.get('handled_per_s'))})</span>"
        )
    parts.append("</div>")
    return parts


def _grid_html(r: dict[str, Any]) -> list[str]:
    """One coloured cell per partition."""
    e = html.escape
    parts = ["<div class='grid'>"]
    for row in r["rows"]:
        owner = row["owner"]
        colour = f" style='background:{owner_colour(owner)}'" if owner else ""
        depth = "-" if row["messages"] is None else row["messages"]
        title = f"partition {row['partition']}: {owner or 'unassigned'}, {row['state']}"
        parts.append(
            f"<div class='cell {row['state']}' data-partition='{row['partition']}'"
            f" data-owner='{e(owner or '')}'{colour} title='{e(title)}'>"
            f"<b>{row['partition']}</b><span class='depth'>{depth}</span><br>"
            f"{e(owner or 'unassigned')}<br><span class='rate'>{_rate(row.get('rate'))}</span>"
            f" <span class='handled'>{_handled_cell(row.get('handled_per_s'))}</span>"
            "</div>"
        )
    parts.append("</div>")
    return parts


def _table(
    heading: str, css: str, columns: Sequence[str], rows: Iterable[tuple[str, Sequence[object]]]
) -> list[str]:
    """``heading``, then a table of class ``css``: one row per (class, cells), cells in HTML."""
    head = "".join(f"<th>{c}</th>" for c in columns)
    parts = [f"{heading}<table class='{css}'><tr>{head}</tr>"]
    for row_class, cells in rows:
        parts.append(f"<tr class='{row_class}'>" if row_class else "<tr>")
        parts.append("".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return [*parts, "</table>"]


def _shown(value: object) -> object:
    return "-" if value is None else value


def _timeline_html(r: dict[str, Any]) -> list[str]:
    """What this coordinator saw lately: rebalances and handoffs."""
    e = html.escape
    timeline = r.get("timeline") or []
    rows = []
    for t in timeline:
        gap = "" if t.get("gap") is None else f"{t['gap'] * 1000:.0f} ms"
        partition = "" if t.get("partition") is None else t["partition"]
        cells = [_when(t["at"]), e(t["kind"]), partition, e(t["detail"]), gap]
        rows.append((e(t["kind"]), cells))
    heading = f"<h3>Recent rebalances and handoffs ({len(timeline)})</h3>"
    return _table(heading, "timeline", ("time", "what", "partition", "detail", "claim gap"), rows)


def _parked_html(r: dict[str, Any]) -> list[str]:
    """The parked keys, if any."""
    e = html.escape
    if not r.get("parked"):
        return []
    heading = (
        f"<h3>Parked keys ({len(r['parked'])}): waiting for <code>partq dlq redrive "
        f"{e(r['stream'])}</code></h3>"
    )
    rows = [
        (
            "",
            [e(k["key"]), k["partition"], _shown(k.get("messages")), e(k["member"]), e(k["error"])],
        )
        for k in r["parked"]
    ]
    columns = ("key", "partition", "messages", "parked by", "error")
    return _table(heading, "parked", columns, rows)


def _members_html(r: dict[str, Any]) -> list[str]:
    """The members table."""
    e = html.escape
    rows = [
        (
            "",
            [
                e(m["id"]),
                m["weight"],
                m["owns"],
                per_second(m.get("handled_per_s")),
                _shown(m.get("concurrency")),
                _shown(m.get("in_flight")),
                _waiting(m),
                f"{m['age_s']:.0f}",
                e(m["host"]),
                m["pid"],
            ],
        )
        for m in r["members"]
    ]
    columns = ["member", "weight", "owns", "handled", "concurrency", "in flight"]
    columns += ["longest key wait", "age (s)", "host", "pid"]
    return _table("<h3>Members</h3>", "members", columns, rows)


def _waiting(member: dict[str, Any]) -> str:
    """The key that waited longest behind its own earlier message, and how long."""
    key = member.get("waiting_key")
    if key is None:
        return "-"
    return f"{member['waiting_s']:.1f} s: {html.escape(key)}"


def _partitions_html(r: dict[str, Any]) -> list[str]:
    """The partitions table."""
    e = html.escape
    rows = [
        (
            row["state"],
            [
                row["partition"],
                e(row["owner"] or "-"),
                row["state"],
                e(row["claim"] or "-"),
                e(row.get("standby") or "-"),
                e(row["queue"]),
                _shown(row["messages"]),
                _shown(row["consumers"]),
                _shown(row.get("in_flight")),
            ],
        )
        for row in r["rows"]
    ]
    columns = ("partition", "owner", "state", "claimed by", "standby", "queue", "messages")
    return _table("<h3>Partitions</h3>", "partitions", (*columns, "consumers", "in flight"), rows)


def _malformed_html(r: dict[str, Any]) -> list[str]:
    """The keys partq did not write, if any."""
    e = html.escape
    if not r.get("malformed"):
        return []
    heading = f"<h3>Malformed keys ({len(r['malformed'])}): ignored as absent</h3>"
    rows = [("", [e(m["key"]), e(m["kind"]), e(m["error"])]) for m in r["malformed"]]
    return _table(heading, "malformed", ("key", "kind", "error"), rows)


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
    forged = report.get("forged_claims", [])
    if forged:
        lines.append(
            f"forged claims ({len(forged)}): not on their member's lease, so not written by "
            f"partq; ignored (the partition counts as unclaimed) and deleted by the leader"
        )
        lines += [f"  partition {f['partition']}: {_claim_lease(f)}" for f in forged]
    unbound = report.get("unbound_claims", [])
    if unbound:
        lines.append(
            f"claims on a lease no live member holds ({len(unbound)}): a departed or restarted "
            f"member's while it drains; honoured until released, until that lease ends, or "
            f"until the leader deletes them (coordinator --unbound-grace)"
        )
        lines += [f"  partition {u['partition']}: {_claim_lease(u)}" for u in unbound]
    return lines


def _claims(state: GroupState, claims: Mapping[int, Claim]) -> list[dict[str, Any]]:
    """Claims not on their member's lease, for the report: whose name, which leases."""
    return [
        {
            "partition": p,
            "member": c.member,
            "lease": f"{c.lease:x}" if c.lease else None,
            "member_lease": f"{m.lease:x}" if (m := state.members.get(c.member)) else None,
        }
        for p, c in sorted(claims.items())
    ]


def _claim_lease(claim: dict[str, Any]) -> str:
    """Whose name a claim carries and which lease it is on, for people."""
    member = claim["member"]
    named = f"{member} (lease {claim['member_lease']})" if claim["member_lease"] else member
    named += "" if claim["member_lease"] else " (not a member)"
    lease = f"lease {claim['lease']}" if claim["lease"] else "no lease"
    return f"names {named} but is on {lease}"
