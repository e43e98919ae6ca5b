"""The randomized fault soak (``python -m benchmarks.chaos``) for 3 minutes with seed 1.

Given the soak's own 3-node RabbitMQ cluster (the machine's version, or 4.0.5 with
``PARTQ_TEST_RABBITMQ=4.0.5``) and 3-member etcd, 2 coordinators, 4-6 consumers and 300
keyed sequences at about 1,000 msg/s, when its seeded nemesis fires a fault every 5-15 s
for 180 s (consumers killed -9, stopped with SIGTERM, frozen with SIGSTOP; etcd members
and the etcd leader killed; RabbitMQ nodes killed; moves, rebalances, drains, scaling),
then nothing confirmed is lost, no two processes handle a partition at once, and every
order violation is a redelivery that a crash's prefetch window explains. The soak runs
as its own process, stopped with SIGTERM (it then stops everything it started by PID)
if it overruns. Its table is printed (``-s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rabbit import Install

EVERY_FAULT = "PARTQ_TEST_EVERY_FAULT"
# On demand, not in CI's default run: a planned handoff can still reorder a prefetch window
# when the old owner reports a partition drained while holding deliveries it has not
# handled (docs/history.md, "Randomized fault soak"), so the soak would fail CI by chance
# until that is fixed; and it adds about 4.5 minutes.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.fault,
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get(EVERY_FAULT), reason=f"on demand: {EVERY_FAULT}=1"),
]

ROOT = Path(__file__).resolve().parents[2]
SEED, DURATION = 1, 180
# clusters up (~40 s on a busy machine), the faults, the last messages handled (at most
# the soak's --drain-wait, 240 s), the clusters stopped
OVERRUN = DURATION + 540


@pytest.mark.timeout(OVERRUN + 120)
def test_three_minutes_of_seeded_faults_lose_nothing(
    tmp_path: Path, rabbit_install: Install
) -> None:
    out = tmp_path / "chaos.json"
    command = [
        sys.executable, "-m", "benchmarks.chaos", "--seed", str(SEED), "--duration",
        str(DURATION), "--out", str(out), "--workdir", str(tmp_path / "soak"),
        "--rabbitmq", "4.0.5" if rabbit_install.chrooted else "machine",
    ]  # fmt: skip
    log = tmp_path / "chaos.out"
    with log.open("wb") as sink:
        soak = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = soak.wait(OVERRUN)
        except subprocess.TimeoutExpired:
            soak.send_signal(signal.SIGTERM)  # the soak stops what it started, by PID
            try:
                soak.wait(120)
            except subprocess.TimeoutExpired:
                os.kill(soak.pid, signal.SIGKILL)
                soak.wait(10)
            pytest.fail(f"the soak ran past {OVERRUN} s:\n{log.read_text()[-4000:]}")
    report = log.read_text()
    print(report[report.find("partq chaos soak") :])
    assert out.exists(), f"the soak wrote no results (exit {code}):\n{report[-4000:]}"
    verdict = json.loads(out.read_text())["verdict"]
    # Then nothing confirmed was lost, no partition had two handlers at once, and every
    # late message was a crashed owner's redelivery
    assert verdict["lost"] == 0, verdict["lost_examples"]
    assert verdict["overlaps"] == 0, verdict["overlap_examples"]
    assert verdict["order_unexplained"] == 0, verdict["order_examples"]
    assert code == 0, report[-4000:]
    # And the nemesis did fire (every 5-15 s, slower while a CLI call or a node's restart
    # takes its time on a busy machine)
    assert sum(verdict["faults"].values()) >= DURATION // 30, verdict["faults"]
