"""The coordinator's recent history for the console: handoffs, claim gaps, depth rates."""

from __future__ import annotations

from partq.coordinator.ops.history import History
from partq.coordinator.ops.status import owner_colour, render_html
from partq.coordinator.store.codec import Claim


def claim(member: str, *, taken_from: str = "") -> Claim:
    return Claim(member, 1, 0.0, bool(taken_from), taken_from)


def test_a_release_then_another_members_claim_is_a_handoff_with_its_gap() -> None:
    history = History()
    history.seed({0: "a"})
    history.rebalanced("membership", 1, at=99.0)
    history.claim(0, None, at=100.0)  # a released partition 0
    history.claim(0, claim("b"), at=100.25)  # b claimed it
    history.claim(1, claim("a"), at=101.0)  # a first claim: nobody handed it over
    history.claim(2, claim("c", taken_from="a"), at=102.0)  # a hot standby took it
    history.claim(1, claim("b"), at=103.0)  # a handed its claim on 1 over to b
    entries = history.entries()
    assert [(e.kind, e.partition, e.detail) for e in entries] == [
        ("handoff", 1, "a → b (handed over)"),
        ("handoff", 2, "a → c (hot standby takeover)"),
        ("handoff", 0, "a → b"),
        ("rebalance", None, "membership: 1 partitions"),
    ]
    assert (entries[0].gap, entries[2].gap) == (0.0, 0.25)


def test_depth_rates_need_a_second_between_samples() -> None:
    history = History()
    assert history.depths({0: 100}, at=10.0) == {}
    assert history.depths({0: 150}, at=10.5) == {}  # too soon: the first sample stands
    assert history.depths({0: 80}, at=12.0) == {0: -10.0}


def test_the_console_colours_each_partition_by_its_owner_without_scripts() -> None:
    rows = [
        {"partition": p, "queue": f"q{p}", "owner": o, "state": s, "claim": o,
         "standby": None, "messages": 5, "consumers": 1, "rate": 2.0}
        for p, o, s in [(0, "a", "consuming"), (1, "b", "moving"), (2, None, "unassigned")]
    ]  # fmt: skip
    report = {
        "stream": "s<x>", "partitions": 3, "queue_type": "quorum", "leader": "k",
        "members": [{"id": m, "weight": 1, "owns": 1, "age_s": 1.0, "host": "h", "pid": 1}
                    for m in ("a", "b")],
        "unassigned": [2], "in_motion": [1], "rows": rows, "beyond_spec": [],
        "timeline": [{"at": 0.0, "kind": "handoff", "detail": "a → b", "partition": 1,
                      "gap": 0.012}],
        "parked": [], "dead_letters": 3,
    }  # fmt: skip
    page = render_html([report])
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert f"data-owner='a' style='background:{owner_colour('a')}'" in page
    assert "class='cell unassigned'" in page and "+2/s" in page
    assert "12 ms" in page and "dead letters: 3" in page
    assert "s&lt;x&gt;" in page and "s<x>" not in page
    assert owner_colour("a") == owner_colour("a") != owner_colour("b")
