"""A real Prometheus (Debian's) scrapes a coordinator and two consumers; we query its API.

The messages are produced in two batches: the first while no consumer runs (so the
queue-depth series has something to show), the second with both consumers up, so
every series the test checks is seen to move, not just to exist.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from partq.producer import Producer, StreamSpec

from .conftest import Launcher, Prometheus, free_port, http_get, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 4
BATCH = 1000  # twice: 2 000 keyed messages in all
KEYS = 200
WAIT = 25.0  # seconds, for any one thing Prometheus should come to see


def produce(spec: StreamSpec, amqp: str, first: int, count: int) -> None:
    with Producer(spec, amqp_url=amqp, name="partq-test-producer") as producer:
        futures = [
            producer.publish(f"key-{n % KEYS:03d}", json.dumps({"n": n}).encode())
            for n in range(first, first + count)
        ]
        producer.flush(30)
    for future in futures:
        future.result(0)


def promtool_check(text: bytes) -> tuple[int, str]:
    """``promtool check metrics`` on an exposition text: (exit code, what it printed)."""
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace").strip()


def test_prometheus_scrapes_partq(
    launcher: Launcher,
    make_stream: Any,
    start_prometheus: Any,
    rabbitmq: str,
    artifacts: Path,
) -> None:
    began = time.monotonic()
    spec = make_stream(PARTITIONS)
    stream = spec.name
    sel = f'stream="{stream}"'
    handled_ok = f'sum(partq_consumer_messages_handled_total{{{sel},outcome="ok"}})'
    seen: dict[str, Any] = {"stream": stream, "partitions": PARTITIONS, "produced": 2 * BATCH}
    timeline: list[dict[str, Any]] = []

    def note(step: str, **values: Any) -> None:
        timeline.append({"t": round(time.monotonic() - began, 2), "step": step, **values})

    coordinator = launcher.coordinator(stream)
    members = ["obs-a", "obs-b"]
    consumer_ports = {m: free_port() for m in members}  # Prometheus is told them up front
    prom: Prometheus = start_prometheus(
        {
            "partq-coordinator": [f"127.0.0.1:{coordinator.port}"],
            "partq-consumer": [f"127.0.0.1:{p}" for p in consumer_ports.values()],
        }
    )
    launcher.wait_ready(coordinator)

    def query(promql: str) -> float | None:
        return prom.scalar(promql)

    try:
        # 1. the coordinator is scraped and leads
        wait_until(lambda: query('up{job="partq-coordinator"}') == 1, WAIT, what="coordinator up")
        wait_until(
            lambda: query(f"sum(partq_coordinator_is_leader{{{sel}}})") == 1, WAIT, what="leader"
        )
        handled_before = query(handled_ok)
        note("leader", is_leader_sum=1, handled_ok=handled_before)

        # 2. first batch with no consumer: the depth series show it, partition by partition
        produce(spec, rabbitmq, 0, BATCH)

        def depth_full() -> list[tuple[dict[str, str], float]] | None:
            series = prom.query(f"partq_queue_messages{{{sel}}}")
            ok = len(series) == PARTITIONS and sum(v for _, v in series) == BATCH
            return series if ok else None

        series = wait_until(depth_full, WAIT, what=f"partq_queue_messages summing to {BATCH}")
        depth_before = {int(m["partition"]): v for m, v in series}
        assert all(v > 0 for v in depth_before.values()), depth_before
        note("queued", queue_messages=depth_before)

        # 3. two consumers: assignment, consumption, queues drain
        consumers = [launcher.consumer(stream, m, port=consumer_ports[m]) for m in members]
        for proc in consumers:
            launcher.wait_ready(proc)
        wait_until(
            lambda: [v for _, v in prom.query("up")] == [1.0] * 3, WAIT, what="up == 1 for all 3"
        )
        assignment = wait_until(
            lambda: _assignment(prom, sel), WAIT, what="one partq_assignment_info per partition"
        )
        assert set(assignment) == set(range(PARTITIONS)), assignment
        assert set(assignment.values()) == set(members), assignment
        handled_mid = wait_until(
            lambda: _at_least(query(handled_ok), BATCH), WAIT, what=f"{BATCH} handled"
        )
        wait_until(lambda: _drained(prom, sel), WAIT, what="queues at 0")
        note("first batch consumed", handled_ok=handled_mid, assignment=assignment)

        # 4. second batch: the counter moves on to the total produced
        produce(spec, rabbitmq, BATCH, BATCH)
        handled_end = wait_until(
            lambda: _at_least(query(handled_ok), 2 * BATCH), WAIT, what=f"{2 * BATCH} handled"
        )
        depth_after = wait_until(lambda: _drained(prom, sel), WAIT, what="queues at 0 again")
        assert handled_end == 2 * BATCH, f"handled {handled_end}, produced {2 * BATCH}"
        assert (handled_before or 0) < handled_mid < handled_end
        per_member = {
            m["member"]: v
            for m, v in prom.query(f'partq_consumer_messages_handled_total{{{sel},outcome="ok"}}')
        }
        assert set(per_member) == set(members) and sum(per_member.values()) == 2 * BATCH
        note(
            "second batch consumed",
            handled_ok=handled_end,
            per_member=per_member,
            queue_messages=depth_after,
        )

        # 5. what else Prometheus holds now
        seen.update(
            {
                "up": {f"{m['job']} {m['instance']}": v for m, v in prom.query("up")},
                "is_leader_sum": query(f"sum(partq_coordinator_is_leader{{{sel}}})"),
                "members": query(f"partq_coordinator_members{{{sel}}}"),
                "partitions_unassigned": query(f"partq_coordinator_partitions_unassigned{{{sel}}}"),
                "partitions_owned": {
                    m["member"]: v
                    for m, v in prom.query(f"partq_consumer_partitions_owned{{{sel}}}")
                },
                "assignment_info": {str(p): o for p, o in sorted(assignment.items())},
                "handled_ok_before": handled_before,
                "handled_ok_after_first_batch": handled_mid,
                "handled_ok_after_second_batch": handled_end,
                "handled_ok_per_member": per_member,
                "queue_messages_no_consumer": {str(p): v for p, v in sorted(depth_before.items())},
                "queue_messages_at_end": {str(p): v for p, v in sorted(depth_after.items())},
            }
        )

        # 6. every endpoint's exposition passes promtool's lint
        lint: dict[str, dict[str, Any]] = {}
        for name, base in [("coordinator", coordinator.base)] + [
            (p.name, p.base) for p in consumers
        ]:
            status, text = http_get(base + "/metrics")
            assert status == 200, f"{name} /metrics: HTTP {status}"
            code, output = promtool_check(text)
            lint[name] = {"exit_code": code, "output": output, "bytes": len(text)}
        seen["promtool_check_metrics"] = lint
    finally:
        seen["timeline"] = timeline
        seen["duration_s"] = round(time.monotonic() - began, 2)
        (artifacts / "prometheus-test.json").write_text(json.dumps(seen, indent=2) + "\n")
    failed = {n: r["output"] for n, r in lint.items() if r["exit_code"] != 0}
    assert not failed, f"promtool check metrics: {failed}"


def _at_least(value: float | None, n: int) -> float | None:
    return value if value is not None and value >= n else None


def _assignment(prom: Prometheus, sel: str) -> dict[int, str] | None:
    series = prom.query(f"partq_assignment_info{{{sel}}} == 1")
    owners = {int(m["partition"]): m["member"] for m, _ in series}
    ok = len(series) == PARTITIONS and len(owners) == PARTITIONS and len(set(owners.values())) == 2
    return owners if ok else None


def _drained(prom: Prometheus, sel: str) -> dict[int, float] | None:
    series = prom.query(f"partq_queue_messages{{{sel}}}")
    depth = {int(m["partition"]): v for m, v in series}
    return depth if len(depth) == PARTITIONS and not any(depth.values()) else None
