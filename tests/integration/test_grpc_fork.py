"""A process that talks to etcd can still spawn children that run Python before exec.

pyspark launches Spark's JVM with ``subprocess.Popen(preexec_fn=...)``; with gRPC's fork
support on, such a child could crash on gRPC's poller before exec'ing (the Spark job
then died with "Java gateway process exited"). partq turns gRPC's fork support off
(``partq/kernel/__init__.py``) unless the application set it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from partq.kernel.local import LocalEtcd

pytestmark = [pytest.mark.integration]

SPAWNS = 300


def test_children_with_a_preexec_fn_start_beside_a_live_etcd_watch(etcd_server: LocalEtcd) -> None:
    # Given a process with a partq etcd client and a live watch
    script = textwrap.dedent(
        f"""
        import os, signal, subprocess
        import partq.kernel
        import etcd3
        client = etcd3.client(host="127.0.0.1", port={etcd_server.port})
        client.put("/partq-fork-test", "0")
        events, cancel = client.watch_prefix("/partq-fork-test")
        failed = 0
        # When it spawns children that run Python between fork and exec, as pyspark does
        for i in range({SPAWNS}):
            done = subprocess.run(
                ["/bin/true"],
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                capture_output=True,
            )
            failed += done.returncode != 0
            if i % 10 == 0:
                client.put("/partq-fork-test", str(i))
        print(os.environ["GRPC_ENABLE_FORK_SUPPORT"], failed, flush=True)
        os._exit(0)
        """
    )
    env = {"PATH": "/usr/bin:/bin"}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", script]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=240, env=env, cwd=root
    )
    # Then every child started (with fork support on, about 5 in 300 crashed before exec)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["false", "0"], done.stdout + done.stderr[-2000:]
