"""The status page's charts: inline SVG line charts of :mod:`partq.coordinator.ops.trends` samples.

Pure: samples in, markup out. No script and no style attributes (colours are SVG
presentation attributes), so the page needs nothing beyond its own HTML.
"""

from __future__ import annotations

import hashlib
import html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from partq.coordinator.ops.trends import Sample

__all__ = ["charts_html", "member_hue"]

_W, _H = 440, 150
_X0, _X1, _Y0, _Y1 = 48, 428, 12, 122  # the plot area
_LEGEND_MAX = 16  # series named under a chart at most
_TICKS = (10.0, 30.0, 60.0, 120.0, 300.0)  # seconds between time labels: four at most
_SPAN_MIN = 60.0  # a young coordinator's charts span its samples, but at least this
_PEAK_MAX = 1e300  # an axis scales to this at most (5 times 10^n stays finite)


def member_hue(member: str) -> int:
    """A stable hue per member (the same on every page and coordinator)."""
    return int(hashlib.sha256(member.encode()).hexdigest()[:4], 16) % 360


def _member_line(member: str) -> str:
    return f"hsl({member_hue(member)},62%,38%)"


def _partition_line(partition: int) -> str:
    return f"hsl({partition * 137.508 % 360:.0f},65%,40%)"  # golden angle: neighbours differ


def _nice(peak: float) -> float:
    """The smallest 1, 2 or 5 times 10^n at or above ``peak`` (1 for an empty chart, and
    for a peak no such number reaches: the loops below would not end at infinity)."""
    if not 0 < peak <= _PEAK_MAX:
        return 1.0
    scale = 1.0
    while scale * 10 <= peak:
        scale *= 10
    while scale > peak:
        scale /= 10
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= peak)


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _chart(
    name: str,
    title: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    colour: Callable[[str], str],
    now: float,
    window: float,
) -> str:
    e = html.escape
    series = {  # a value that is not finite (a hostile report) is left out, never drawn
        label: [(at, v) for at, v in points if math.isfinite(at) and math.isfinite(v)]
        for label, points in series.items()
    }
    top = _nice(max((v for points in series.values() for _, v in points), default=0.0))

    def x(at: float) -> float:
        return _X0 + (at - (now - window)) / window * (_X1 - _X0)

    def y(value: float) -> float:
        return _Y1 - value / top * (_Y1 - _Y0)

    parts = [
        f"<figure class='chart'><figcaption>{e(title)}</figcaption>"
        f"<svg class='chart' data-chart='{name}' data-series='{len(series)}' "
        f"xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}' "
        f"viewBox='0 0 {_W} {_H}' role='img' aria-label='{e(title)}'>"
    ]
    for value in (0.0, top / 2, top):
        parts.append(
            f"<line x1='{_X0}' x2='{_X1}' y1='{y(value):.1f}' y2='{y(value):.1f}' "
            f"stroke='#ddd'/><text x='{_X0 - 4}' y='{y(value) + 4:.1f}' font-size='10' "
            f"text-anchor='end' fill='#555'>{_number(value)}</text>"
        )
    step = next((t for t in _TICKS if window / t <= 4), _TICKS[-1])
    for back in range(int(window // step), -1, -1):
        at = now - back * step
        ago = back * step
        label = "now" if back == 0 else f"-{ago // 60:.0f} min" if ago >= 60 else f"-{ago:.0f} s"
        parts.append(
            f"<text x='{x(at):.1f}' y='{_H - 12}' font-size='10' text-anchor='middle' "
            f"fill='#555'>{label}</text>"
        )
    for label, points in series.items():
        if not points:
            continue
        stroke = colour(label)
        coords = " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in points)
        last_at, last = points[-1]
        parts.append(
            f"<polyline class='series' data-name='{e(label)}' data-points='{len(points)}' "
            f"fill='none' stroke='{stroke}' stroke-width='1.5' points='{coords}'>"
            f"<title>{e(label)}: {_number(last)}</title></polyline>"
            f"<circle cx='{x(last_at):.1f}' cy='{y(last):.1f}' r='2.5' fill='{stroke}'/>"
        )
    parts.append("</svg>")
    names = list(series)
    if names and len(names) <= _LEGEND_MAX:
        parts.append("<div class='chart-legend'>")
        parts.extend(
            f"<svg width='10' height='10'><rect width='10' height='10' fill='{colour(n)}'/></svg>"
            f" {e(n)} "
            for n in names
        )
        parts.append("</div>")
    elif names:
        parts.append(f"<div class='chart-legend'>{len(names)} lines (hover for names)</div>")
    parts.append("</figure>")
    return "".join(parts)


def charts_html(samples: Sequence[Sample], now: float, window: float) -> str:
    """Four charts: handled per second and queue depth, per member and per partition, over
    ``window`` seconds, or since the first sample if that is more recent (a coordinator that
    just started shows its first minute across the chart, not squeezed against "now")."""
    if samples:
        window = min(window, max(_SPAN_MIN, now - samples[0].at))

    def by_member(values: Callable[[Sample], Mapping[str, float]]) -> dict[str, list[Any]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for s in samples:
            for member, value in sorted(values(s).items()):
                out.setdefault(member, []).append((s.at, value))
        return dict(sorted(out.items()))

    def by_partition(values: Callable[[Sample], Mapping[int, float]]) -> dict[str, list[Any]]:
        out: dict[int, list[tuple[float, float]]] = {}
        for s in samples:
            for partition, value in values(s).items():
                out.setdefault(partition, []).append((s.at, value))
        return {f"p{p}": points for p, points in sorted(out.items())}

    def partition_colour(label: str) -> str:
        return _partition_line(int(label[1:]))

    minutes = f"last {window / 60:.0f} min" if window >= 60 else f"last {window:.0f} s"
    return (
        f"<div class='charts' data-samples='{len(samples)}'>"
        + _chart(
            "member-handled",
            f"handled per second, per member ({minutes})",
            by_member(lambda s: s.member_handled),
            _member_line,
            now,
            window,
        )
        + _chart(
            "member-depth",
            f"queue depth of its partitions, per member ({minutes})",
            by_member(lambda s: s.member_depth),
            _member_line,
            now,
            window,
        )
        + _chart(
            "partition-handled",
            f"handled per second, per partition ({minutes})",
            by_partition(lambda s: s.partition_handled),
            partition_colour,
            now,
            window,
        )
        + _chart(
            "partition-depth",
            f"queue depth, per partition ({minutes})",
            by_partition(lambda s: s.partition_depth),
            partition_colour,
            now,
            window,
        )
        + "</div>"
    )
