"""The etcd edge: connecting, and translating etcd3/grpc errors into partq's.

python3-etcd3 marks a failed endpoint unusable for ``time_retry`` seconds
(300 by default), which would turn a 10 s etcd outage into 5 minutes of
errors; endpoints here are built with ``time_retry=0`` and failover on.

python3-etcd3 0.13.0's watcher thread calls ``six.itervalues`` without
importing ``six`` when a watch stream ends (etcd restarted or unreachable): the
thread dies with ``NameError`` and no callback hears of it, so a watcher would
wait forever. :func:`_patch_watch_termination` supplies the missing name, so
callbacks get the error (or ``None``) and partq resyncs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import etcd3
import etcd3.exceptions
import etcd3.transactions
import grpc

from kernel.errors import EtcdUnavailable, UsageError
from kernel.settings import Settings

__all__ = ["connect", "etcd_errors", "lease_is"]


def _patch_watch_termination() -> None:
    import types

    import etcd3.watch

    if not hasattr(etcd3.watch, "six"):
        etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))


_patch_watch_termination()


@contextmanager
def etcd_errors(where: str) -> Iterator[None]:
    """Translate etcd3/grpc errors raised inside into :class:`EtcdUnavailable`."""
    try:
        yield
    except (etcd3.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as e:
        if isinstance(e, ValueError) and "failed node" not in str(e):
            raise
        detail = _detail(e)
        raise EtcdUnavailable(
            f"cannot reach etcd at {where}: is it running? (set PARTQ_ETCD_ENDPOINTS or "
            f"--etcd-endpoints) ({detail})"
        ) from None


def _detail(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        code = error.code() if hasattr(error, "code") else None
        text = error.details() if hasattr(error, "details") else ""
        return f"{code.name if code else 'grpc'}: {text}"
    return str(error) or type(error).__name__


def connect(settings: Settings) -> Any:
    """An etcd3 client for ``settings``, checked with one status call."""
    where = settings.etcd_endpoints
    creds = None
    if settings.etcd_ca is not None or any(ep[2] for ep in settings.endpoints):
        if settings.etcd_ca is None:
            raise UsageError(f"etcd endpoints {where} use https: set --etcd-ca (PARTQ_ETCD_CA)")
        if (settings.etcd_cert is None) != (settings.etcd_key is None):
            raise UsageError("set both --etcd-cert and --etcd-key, or neither")
        try:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
                str(settings.etcd_ca),
                str(settings.etcd_key) if settings.etcd_key else None,
                str(settings.etcd_cert) if settings.etcd_cert else None,
            )
        except OSError as e:
            raise UsageError(f"cannot read the etcd TLS files: {e}") from None
    if (settings.etcd_user is None) != (settings.etcd_password is None):
        raise UsageError("set both the etcd user and password, or neither")
    endpoints = [
        etcd3.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=0.0)
        for host, port, _tls in settings.endpoints
    ]
    password = settings.etcd_password.get_secret_value() if settings.etcd_password else None
    with etcd_errors(where):
        client = etcd3.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=settings.etcd_timeout,
            user=settings.etcd_user,
            password=password,
            failover=True,
        )
        client.status()
    return client


class _LeaseCompare(etcd3.transactions.BaseCompare):  # type: ignore[misc]
    """``Compare(key).lease == id`` — python3-etcd3 has no helper for the LEASE target."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcd3.etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def lease_is(key: str, lease_id: int) -> Any:
    """A transaction comparison that holds while ``key`` is attached to ``lease_id``."""
    return _LeaseCompare(key) == lease_id
