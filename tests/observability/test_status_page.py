"""The coordinator's status page, rendered by headless Chromium (Debian's ``chromium``).

Asserts on the DOM Chromium built (``--dump-dom``), not on the HTML the server
sent, and keeps a screenshot as ``artifacts/status-page.png``.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from partq.producer import Producer

from .conftest import Launcher, http_get, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
PARTITIONS = 8
MEMBERS = ("obs-a", "obs-b")
PLOT_BOTTOM = 122.0  # the y of a chart's 0 (coordinator/ops/charts.py)


@dataclass
class Table:
    cls: str
    header: list[str] = field(default_factory=list)
    rows: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (tr class, cells)


class PageParser(HTMLParser):
    """Tables (header, rows as dicts keyed by header) and ``<meta>`` tags of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[Table] = []
        self.metas: list[dict[str, str]] = []
        self.cells: list[dict[str, str]] = []  # the console grid's partition cells
        self.charts: dict[str, list[dict[str, str]]] = {}  # chart name -> its polylines
        self._row: tuple[str, list[str]] | None = None
        self._cell: list[str] | None = None
        self._header = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "meta":
            self.metas.append(a)
        elif tag == "div" and "cell" in a.get("class", "").split():
            self.cells.append(a)
        elif tag == "svg" and a.get("class") == "chart":
            self.charts[a["data-chart"]] = []
        elif tag == "polyline" and self.charts:
            self.charts[list(self.charts)[-1]].append(a)
        elif tag == "table":
            self.tables.append(Table(a.get("class", "")))
        elif tag == "tr" and self.tables:
            self._row = (a.get("class", ""), [])
            self._header = False
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
            self._header = tag == "th"

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row[1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            table = self.tables[-1]
            cls, cells = self._row
            if self._header and not table.header:
                table.header = cells
            else:
                table.rows.append((cls, dict(zip(table.header, cells, strict=True))))
            self._row = None


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    return parser


def partitions_table(page: PageParser) -> Table:
    tables = [t for t in page.tables if t.cls == "partitions"]
    assert len(tables) == 1, f"{len(tables)} tables with class 'partitions'"
    return tables[0]


def members_table(page: PageParser) -> Table:
    tables = [t for t in page.tables if t.header[:1] == ["member"]]
    assert len(tables) == 1, f"{len(tables)} members tables"
    return tables[0]


def grid(page: PageParser) -> dict[int, tuple[str, str]]:
    """partition -> (owner, background) of the console's grid cells."""
    return {int(c["data-partition"]): (c["data-owner"], c.get("style", "")) for c in page.cells}


def timeline(page: PageParser) -> list[dict[str, str]]:
    tables = [t for t in page.tables if t.cls == "timeline"]
    assert len(tables) == 1, f"{len(tables)} timeline tables"
    return [row for _, row in tables[0].rows]


def owners(page: PageParser) -> dict[int, tuple[str, str, str]]:
    """partition -> (owner, state cell, row class)."""
    return {
        int(r["partition"]): (r["owner"], r["state"], cls) for cls, r in partitions_table(page).rows
    }


def settled(url: str, members: set[str]) -> dict[int, tuple[str, str, str]] | None:
    """The server's page (no browser) once every partition is consumed by one of ``members``
    and each of them owns some; None before."""
    status, body = http_get(url)
    if status != 200:
        return None
    rows = owners(parse(body.decode()))
    ok = (
        len(rows) == PARTITIONS
        and all(state == "consuming" and owner in members for owner, state, _ in rows.values())
        and {owner for owner, _, _ in rows.values()} == members
    )
    return rows if ok else None


def both_handling(url: str) -> bool:
    """Whether the server's page shows a handled rate above 0 for every member."""
    status, body = http_get(url)
    if status != 200:
        return False
    rates = [r["handled"] for _, r in members_table(parse(body.decode())).rows]
    return len(rates) == len(MEMBERS) and all(r != "-" and float(r[:-2]) > 0 for r in rates)


def charted(url: str, points: int) -> bool:
    """Whether the server's page charts every member's handled rate with ``points`` samples."""
    status, body = http_get(url)
    if status != 200:
        return False
    lines = parse(body.decode()).charts.get("member-handled", [])
    return {line["data-name"] for line in lines} == set(MEMBERS) and all(
        int(line["data-points"]) >= points for line in lines
    )


def heights(line: dict[str, str]) -> list[float]:
    """The y coordinates of a polyline's points (larger is lower)."""
    return [float(point.split(",")[1]) for point in line["points"].split()]


def chromium(url: str, screenshot: Path, profile: Path) -> str:
    """Load ``url`` in headless Chromium: the rendered DOM, and a screenshot written."""
    screenshot.unlink(missing_ok=True)
    argv = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--screenshot={screenshot}",
        "--window-size=1280,1600",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    err = done.stderr.decode(errors="replace")[-2000:]
    assert done.returncode == 0, f"chromium exited {done.returncode}: {err}"
    assert screenshot.is_file() and screenshot.stat().st_size > 0, f"no screenshot: {err}"
    return done.stdout.decode()


@pytest.fixture
def browser() -> Path:
    if not (CHROMIUM.exists() and os.access(CHROMIUM, os.X_OK)):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is required in CI", pytrace=False)
        pytest.skip(f"{CHROMIUM} is not installed")
    return CHROMIUM


def test_status_page_in_chromium(
    browser: Path, launcher: Launcher, make_stream: Any, artifacts: Path, tmp_path: Path
) -> None:
    spec = make_stream(PARTITIONS)
    coordinator = launcher.coordinator(spec.name)
    consumers = {m: launcher.consumer(spec.name, m, None, "--load-report", "1") for m in MEMBERS}
    launcher.wait_ready(coordinator)
    for proc in consumers.values():
        launcher.wait_ready(proc)
    url = coordinator.base + "/"
    wait_until(lambda: settled(url, set(MEMBERS)), 30, what="8 partitions consumed by both")

    # both members handling a steady load: each one's throughput is on the page
    with Producer(spec, amqp_url=launcher.amqp) as producer:
        stop = threading.Event()

        def publish() -> None:
            for i in range(20_000):  # bounded: 100 s at 200/s at most
                if stop.wait(0.005):
                    return
                producer.publish(f"key-{i % 64}", b"{}")

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        try:
            wait_until(lambda: both_handling(url), 30, what="both members' handled rate > 0")
            # the charts sample every 5 s: wait for three samples of each member's rate
            wait_until(lambda: charted(url, 3), 40, interval=1, what="3 samples charted")
            # what Chromium rendered
            shot = artifacts / "status-page.png"
            page = parse(chromium(url, shot, tmp_path / "chromium-1"))
        finally:
            stop.set()
            thread.join(10)
        producer.flush(30)
    handled = {r["member"]: r["handled"] for _, r in members_table(page).rows}
    assert all(rate.endswith("/s") and float(rate[:-2]) > 0 for rate in handled.values()), handled
    refresh = [m for m in page.metas if m.get("http-equiv", "").lower() == "refresh"]
    assert refresh and refresh[0].get("content") == "2", page.metas
    rows = owners(page)
    assert sorted(rows) == list(range(PARTITIONS)), rows
    for p, (owner, state, cls) in rows.items():
        assert owner in MEMBERS and state == "consuming" and cls == "consuming", (p, rows[p])
    counts = {m: sum(1 for o, _, _ in rows.values() if o == m) for m in MEMBERS}
    assert counts == {m: PARTITIONS // 2 for m in MEMBERS}, counts
    listed = {r["member"]: int(r["owns"]) for _, r in members_table(page).rows}
    assert listed == counts, listed
    # the console's grid: one cell per partition, coloured by its owner, two colours
    cells = grid(page)
    assert {p: o for p, (o, _) in cells.items()} == {p: o for p, (o, _, _) in rows.items()}
    colours = {o: {bg for oo, bg in cells.values() if oo == o} for o in MEMBERS}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert colours["obs-a"] != colours["obs-b"]

    # the charts: inline SVG, per member and per partition, with the sampled data
    assert set(page.charts) == {
        "member-handled",
        "member-depth",
        "partition-handled",
        "partition-depth",
    }, page.charts
    for chart in ("member-handled", "member-depth"):
        assert {line["data-name"] for line in page.charts[chart]} == set(MEMBERS), chart
    partition_lines = {line["data-name"] for line in page.charts["partition-depth"]}
    assert partition_lines == {f"p{p}" for p in range(PARTITIONS)}
    for line in page.charts["member-handled"]:
        assert int(line["data-points"]) >= 3, line
        assert min(heights(line)) < PLOT_BOTTOM, f"{line['data-name']}: a line at 0: {line}"

    # one member leaves (SIGTERM, by PID): a later load shows the other owning all 8
    rows_before, timeline_before = rows, timeline(page)
    leaving, staying = consumers["obs-b"], "obs-a"
    assert leaving.terminate(timeout=20) == 0, leaving.tail()
    wait_until(lambda: settled(url, {staying}), 30, what=f"all partitions owned by {staying}")
    page = parse(chromium(url, artifacts / "status-page-after-leave.png", tmp_path / "chromium-2"))
    rows = owners(page)
    assert len(rows) == PARTITIONS
    assert all(v == (staying, "consuming", "consuming") for v in rows.values()), rows
    listed = {r["member"]: int(r["owns"]) for _, r in members_table(page).rows}
    assert listed == {staying: PARTITIONS}, listed
    assert {o for o, _ in grid(page).values()} == {staying}
    # and the timeline shows the leaver's partitions handed over, each with its claim gap
    handoffs = [t for t in timeline(page) if t["what"] == "handoff" and t not in timeline_before]
    via = {f"obs-b → {staying}", f"obs-b → {staying} (handed over)"}  # deleted, or handed
    moved = {int(t["partition"]) for t in handoffs if t["detail"] in via}
    assert moved == {p for p, (o, _, _) in rows_before.items() if o == "obs-b"}, handoffs
    assert all(t["claim gap"].endswith(" ms") for t in handoffs if t["detail"].startswith("obs-b"))
