"""The status page and ``partq status --json`` on a member's concurrency: its setting, the
messages in its handlers per member and per partition, and its longest-waiting key."""

from __future__ import annotations

import time
from typing import Any

from partq.coordinator.ops.status import render_html, snapshot_status
from partq.coordinator.store import codec
from partq.coordinator.store.codec import Concurrency, LoadReport, Member
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd
from tests.observability.test_status_page import PageParser, parse


def _status(partitions: int, report: LoadReport) -> tuple[dict[str, Any], PageParser]:
    """The status of a stream whose one member, "b", owns every partition and last
    reported ``report``; and its page, parsed."""
    fake = FakeEtcd()
    registry = Registry(fake, "fake")
    registry.create(StreamSpec("orders", partitions))
    b = Session(fake, "fake", ttl=5)
    fake.put(keys.member("orders", "b"), codec.encode_member(Member("b")), lease=b.lease)
    for p in range(partitions):
        fake.put(keys.assignment("orders", p), codec.encode_assignment("b"))
    Group(fake, "fake", "orders").report_load(report, b)
    status = snapshot_status(registry, None, "orders", depths=lambda _spec: [])  # type: ignore[arg-type]
    b.close()
    return status, parse(render_html([status]))


def _rows(page: PageParser, cls: str) -> list[dict[str, str]]:
    [table] = [t for t in page.tables if t.cls == cls]
    return [row for _, row in table.rows]


def test_the_status_shows_concurrency_in_flight_and_the_longest_waiting_key() -> None:
    # Given member b of 2 partitions reporting --concurrency 16, 5 messages in handlers (4
    # of partition 0, 1 of 1), and a key waiting 2.5 s behind its own
    c = Concurrency(16, {0: 4, 1: 1}, "'<hot>'", 2.5)
    report = LoadReport("b", {0: 10.0, 1: 2.0}, time.time(), 5.0, in_flight=5, concurrency=c)
    # When the status is read and rendered
    status, page = _status(2, report)
    # Then the member shows its setting, what it holds and the waiting key (escaped)
    [member] = status["members"]
    assert (member["concurrency"], member["in_flight"]) == (16, 5)
    assert (member["waiting_key"], member["waiting_s"]) == ("'<hot>'", 2.5)
    [row] = _rows(page, "members")
    assert (row["concurrency"], row["in flight"]) == ("16", "5")
    assert row["longest key wait"] == "2.5 s: '<hot>'"
    # And each partition what its owner has of it in handlers
    assert [r["in_flight"] for r in status["rows"]] == [4, 1]
    assert [r["in flight"] for r in _rows(page, "partitions")] == ["4", "1"]


def test_a_member_from_an_older_partq_shows_dashes() -> None:
    # Given a member whose load report has no concurrency (an older partq wrote it)
    _, page = _status(1, LoadReport("b", {0: 1.0}, time.time(), 5.0))
    # Then the page shows dashes, not zeros
    [row] = _rows(page, "members")
    assert (row["concurrency"], row["in flight"], row["longest key wait"]) == ("-", "-", "-")
    assert [r["in flight"] for r in _rows(page, "partitions")] == ["-"]
