"""The wire contract from another language: the Node.js producer of ``examples/node``.

Its hash must put every golden vector's key where partq's does, and what it publishes
(confirmed, persistent, with partq's headers) must be handled by partq's consumers, each
key in publish order. ``npm ci`` installs the example's locked dependencies in a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from partq.producer.contract import partition_for

from examples import audit
from tests.conftest import DATA, _unavailable
from tests.integration.groups.harness import ROOT, Fleet
from tests.polling import wait_until

pytestmark = [pytest.mark.integration]

EXAMPLE = ROOT / "examples" / "node"
VECTORS = DATA / "partition-vectors.json"


@pytest.fixture(scope="module")
def node_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the example with its locked dependencies installed (``npm ci``)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _unavailable("node and npm (Node.js 20 or later)")
    folder = tmp_path_factory.mktemp("node") / "example"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("node_modules"))
    installed = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert installed.returncode == 0, f"npm ci failed:\n{installed.stderr[-3000:]}"
    return folder


def node(
    folder: Path, *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", *args],
        cwd=folder,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def amqp_env(fleet: Fleet) -> dict[str, str]:
    return {**os.environ, "PARTQ_AMQP_URL": fleet.amqp}


def test_the_node_hash_matches_every_golden_vector(node_example: Path, tmp_path: Path) -> None:
    # Given the repository's golden vectors
    vectors = json.loads(VECTORS.read_text())
    expected = sum(len(v["partition"]) for v in vectors["vectors"])
    # When the Node example checks its partitionFor against them
    checked = node(node_example, "vectors.js", str(VECTORS))
    # Then every key lands in the named partition for every partition count
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout) == {
        "vectors": len(vectors["vectors"]),
        "checked": expected,
        "problems": [],
    }
    # And the check can fail: one vector off by one is reported
    vectors["vectors"][7]["partition"]["271"] += 1
    (tmp_path / "wrong.json").write_text(json.dumps(vectors))
    wrong = node(node_example, "vectors.js", str(tmp_path / "wrong.json"))
    assert wrong.returncode == 1
    assert json.loads(wrong.stdout)["problems"] == [
        f"key {json.dumps(vectors['vectors'][7]['key'], ensure_ascii=False)} mod 271: "
        f"{vectors['vectors'][7]['partition']['271'] - 1}, "
        f"expected {vectors['vectors'][7]['partition']['271']}"
    ]


def test_partq_consumers_handle_what_node_publishes_in_key_order(
    node_example: Path, quorum_fleet: Callable[..., Fleet]
) -> None:
    # Given a 4-partition stream with a coordinator and a consumer recording what it handles
    partitions = 4
    fleet = quorum_fleet(partitions)
    fleet.coordinator()
    consumer = fleet.consumer("c1")
    keys = [f"key-{i:02d}" for i in range(30)] + [f"Ünïcødé-ключ-键-{i}" for i in range(10)]
    rounds = 50
    lines = [
        json.dumps({"key": key, "body": {"key": key, "seq": seq}, "message_id": f"{key}:{seq}"})
        for seq in range(rounds)
        for key in keys
    ]
    env = amqp_env(fleet)

    # When the Node producer publishes them, in order, with confirms
    sent = node(
        node_example, "produce.js", fleet.stream, str(partitions), stdin="\n".join(lines), env=env
    )

    # Then every message is confirmed
    assert sent.returncode == 0, sent.stdout + sent.stderr
    total = len(keys) * rounds
    assert json.loads(sent.stdout) == {
        "sent": total,
        "confirmed": total,
        "failed": 0,
        "errors": [],
    }

    # And handled by partq, each key in its own partition, in publish order, none lost
    def handled() -> list[dict[str, object]]:
        assert consumer.alive(), f"the consumer exited:\n{consumer.tail()}"
        return fleet.records()

    wait_until(lambda: len(handled()) >= total, 120, interval=0.2, what=f"{total} handled")
    records = fleet.records()
    published = [(key, seq) for seq in range(rounds) for key in keys]
    assert audit.lost(published, records) == []
    assert audit.order_violations(records) == []
    assert {(r["key"], r["partition"]) for r in records} == {
        (key, partition_for(key, partitions)) for key in keys
    }
    assert {r["message_id"] for r in records} == {f"{k}:{s}" for k, s in published}
    assert "wrong_partition" not in consumer.tail(200)


def test_the_node_producer_refuses_another_partition_count(
    node_example: Path, quorum_fleet: Callable[..., Fleet]
) -> None:
    # Given a 4-partition stream
    fleet = quorum_fleet(4)
    line = json.dumps({"key": "k", "body": "never sent"})
    for wrong in ("3", "5"):
        # When the Node producer is told another count
        run = node(node_example, "produce.js", fleet.stream, wrong, stdin=line, env=amqp_env(fleet))
        # Then it refuses in one line before sending anything
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stdout == ""
        assert "pass its partition count" in run.stderr or "create it" in run.stderr
