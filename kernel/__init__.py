"""Code every partq package shares (errors, logging, settings, etcd and AMQP plumbing).

``__version__`` is the installed distribution's version: pyproject.toml's ``version``
is its one source. A source tree that is not installed reports ``0+unknown``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("partq")
except PackageNotFoundError:  # running from a checkout that was never pip-installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
