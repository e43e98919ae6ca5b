"""What :func:`consumers.run` adds for an application's ``main``: logs, and exit codes.

``partq consume`` has the CLI for both; an application calling ``consumers.run``
has neither. So ``run`` sets up partq's logging when the application has not
(the root logger has no handler), and a failure before the daemon runs (a bad
handler, setting or config value; no such stream; etcd unreachable) is one
logged line and the CLI's exit code for it (2 for a usage error, else 1), not a
traceback. Errors that are not partq's are bugs and propagate as they are.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec

from partq.kernel import logs
from partq.kernel.errors import PartqError, exit_code
from partq.kernel.terminal import one_line

__all__ = ["entry_point"]

log = logging.getLogger("partq.consumer")

P = ParamSpec("P")


def entry_point(run: Callable[P, int]) -> Callable[P, int]:
    """``run`` with partq's logging set up unless configured, and partq errors as codes."""

    @functools.wraps(run)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> int:
        logs.configure_if_unset("INFO")
        try:
            return run(*args, **kwargs)
        except PartqError as error:
            code = exit_code(error)
            log.error("%s (exit %d)", one_line(str(error)), code)
            return code

    return wrapper
