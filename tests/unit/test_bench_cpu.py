"""The benchmarks' reading of how busy the cores were (benchmarks.cpu), and the planned
benchmark's warning for a saturated machine, on made-up /proc/stat lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cpu import busy_share, jiffies
from benchmarks.planned import SATURATED, busy


def stat(tmp_path: Path, user: int, system: int, idle: int, iowait: int) -> Path:
    path = tmp_path / "stat"
    path.write_text(f"cpu  {user} 0 {system} {idle} {iowait} 0 5 0 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\n")
    return path


def test_idle_and_iowait_are_not_busy(tmp_path: Path) -> None:
    assert jiffies(stat(tmp_path, 100, 20, 300, 40)) == (125, 465)  # softirq 5 is busy


def test_the_busy_share_between_two_readings(tmp_path: Path) -> None:
    before = jiffies(stat(tmp_path, 100, 20, 300, 40))
    after = jiffies(stat(tmp_path, 190, 30, 310, 40))  # 100 busy, 10 idle jiffies later
    assert busy_share(before, after) == pytest.approx(100 / 110)
    assert busy_share(after, after) == 0.0  # no time passed: not a division by zero


def test_a_saturated_round_is_named_in_the_header() -> None:
    calm = busy([{"busy": 0.42}, {"busy": 0.61}])
    assert calm.endswith("busy 42%/61% (by round)")
    assert "saturated" not in calm
    hot = busy([{"busy": 0.42}, {"busy": SATURATED + 0.05}])
    assert "saturated machine" in hot
