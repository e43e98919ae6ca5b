"""Code every partq package shares (errors, logging, settings, etcd and AMQP plumbing).

``__version__`` is the installed distribution's version: pyproject.toml's ``version``
is its one source. A source tree that is not installed reports ``0+unknown``.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

# gRPC (the etcd client's transport) restarts its poller in a forked child when its fork
# support is on; a child that then runs Python before exec (subprocess's preexec_fn, as
# pyspark's gateway launch does) can crash on gRPC's wakeup-fd check instead of exec'ing:
# 5 of 300 such spawns beside a live etcd watch failed, 0 of 300 with it off. partq never
# uses gRPC in a forked child, so it is off unless the application set it. Set here, the
# one module every partq package imports before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

try:
    __version__ = version("partq")
except PackageNotFoundError:  # running from a checkout that was never pip-installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
