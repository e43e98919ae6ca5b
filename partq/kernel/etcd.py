"""The etcd edge: connecting, authenticating for the life of the process, and translating
etcd3/grpc errors into partq's.

python3-etcd3 marks a failed endpoint unusable for ``time_retry`` seconds
(300 by default), which would turn a 10 s etcd outage into 5 minutes of
errors; endpoints here are built with ``time_retry=0`` and failover on.

python3-etcd3 0.13.0's watcher thread calls ``six.itervalues`` without
importing ``six`` when a watch stream ends (etcd restarted or unreachable): the
thread dies with ``NameError`` and no callback hears of it, so a watcher would
wait forever. :func:`_patch_watch_termination` supplies the missing name, so
callbacks get the error (or ``None``) and partq resyncs. (partq's own
:class:`Client` runs each watch on its own stream and does not use that thread.)

**Authentication.** With a user and password, etcd hands out a token that dies
after ``--auth-token-ttl`` seconds without use (300 by default) and when the
user's password changes; python3-etcd3 authenticates once, so every call after
a quiet spell failed with "invalid auth token" forever. :class:`Client` sends
its *current* token with each call and, when etcd says the token is invalid or
stale, authenticates again (once, for all threads) and retries the call once:
unary calls, transactions, lease grant/keep-alive/revoke and watch creation.
A watch stream keeps the token it was opened with and etcd checks it only when
a watch is created on that stream, so each watch gets its own stream, opened
with the token current at the time; an established watch keeps delivering
after its token expired. (python3-etcd3's one shared stream returned watch id
``-1`` and never delivered anything once the stream's token had expired, and
did the same, silently, for a watch the user may not make.) Passwords and
tokens travel only over TLS: :func:`connect` refuses a user with plain
``http://`` endpoints. With a client certificate and no password, etcd (with
``--client-cert-auth``) takes the certificate's CN as the user: there is no
token to expire. See docs/security.md.

**Errors.** :func:`etcd_errors` turns a failure into one line that names its
cause: authentication failed (:class:`EtcdAuthFailed`), a certificate not
trusted or a client certificate required or refused (:class:`EtcdTLSError`),
permission denied on a key (:class:`EtcdPermissionDenied`) — the three are
:class:`EtcdRefused`, never retried — a revision etcd compacted away, asked for by a read
or a watch (:class:`EtcdCompacted`: read afresh), or not reachable
(:class:`EtcdUnavailable`, retried).

**The client surface.** :class:`EtcdClient` is the typed protocol of the python3-etcd3
calls partq makes: :class:`Client` has them, and so does ``tests.fakes.etcd.FakeEtcd``
(mypy checks it), which unit tests use in its place.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import etcd3
import etcd3.events
import etcd3.exceptions
import etcd3.transactions
import etcd3.utils
import etcd3.watch
import grpc

from partq.kernel.errors import (
    EtcdAuthFailed,
    EtcdCompacted,
    EtcdError,
    EtcdPermissionDenied,
    EtcdTLSError,
    EtcdUnavailable,
    UsageError,
)
from partq.kernel.settings import Settings

__all__ = [
    "CallFailed",
    "Client",
    "EtcdClient",
    "Identity",
    "connect",
    "etcd_errors",
    "lease_is",
    "translate",
]

log = logging.getLogger("partq.etcd")

T = TypeVar("T")


def _patch_watch_termination() -> None:
    import types

    if not hasattr(etcd3.watch, "six"):
        etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))


_patch_watch_termination()


# -- the client surface ----------------------------------------------------------------


class EtcdClient(Protocol):
    """The python3-etcd3 client calls partq makes (values and metadata are etcd3's types).

    Keys are text; a ``lease`` argument is an ``etcd3.Lease`` (or None). ``transactions``
    builds the comparisons and operations of :meth:`transaction`
    (``etcd3.client.Transactions``, and :func:`lease_is`)."""

    @property
    def transactions(self) -> Any: ...

    def status(self) -> Any: ...

    def close(self) -> None: ...

    def get(self, key: str, revision: int | None = None) -> tuple[bytes | None, Any]:
        """The value and metadata of ``key`` (at ``revision``: as it was then)."""

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> Iterable[tuple[bytes, Any]]:
        """Every key under ``prefix`` with its value (``keys_only``: an empty value)."""

    def get_prefix_response(self, prefix: str) -> Any: ...

    def put(self, key: str, value: str | bytes, lease: Any = None) -> Any: ...

    def delete(self, key: str) -> Any: ...

    def delete_prefix(self, prefix: str) -> Any: ...

    def transaction(
        self, compare: list[Any], success: list[Any], failure: list[Any]
    ) -> tuple[bool, list[Any]]: ...

    def lease(self, ttl: int, lease_id: int | None = None) -> Any: ...

    def refresh_lease(self, lease_id: int) -> Iterable[Any]: ...

    def revoke_lease(self, lease_id: int) -> Any: ...

    def get_lease_info(self, lease_id: int) -> Any: ...

    def add_watch_prefix_callback(
        self, prefix: str, callback: Callable[[Any], None], *, start_revision: int | None = None
    ) -> int: ...

    def add_watch_callback(
        self, key: str, callback: Callable[[Any], None], *, start_revision: int | None = None
    ) -> int: ...

    def cancel_watch(self, watch_id: int) -> None: ...

    def watch_once(self, key: str, timeout: float | None = None) -> Any: ...


# -- who we are, and how a call failed ------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """How a client authenticates, for error messages. Never holds the password."""

    user: str | None = None
    ca: str | None = None  # our CA file: set when the endpoints use TLS
    cert: str | None = None  # our client certificate file

    def who(self) -> str:
        if self.user is not None:
            return f"etcd user {self.user!r}"
        if self.cert is not None:
            return f"the etcd user named by the CN of {self.cert}"
        return "a client without credentials"


class CallFailed(etcd3.exceptions.Etcd3Exception):  # type: ignore[misc]
    """An etcd call failed: the gRPC status, what was being done, to which key, by whom."""

    def __init__(
        self,
        code: grpc.StatusCode | None,
        details: str,
        identity: Identity,
        op: str = "",
        key: str | None = None,
    ) -> None:
        super().__init__(f"{code.name if code is not None else 'error'}: {details}")
        self.code = code
        self.details = details
        self.identity = identity
        self.op = op
        self.key = key


class _Status(grpc.RpcError):  # type: ignore[misc]
    """A gRPC-like status for failures that arrive as data (a canceled watch creation)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _cancel_status(reason: str) -> _Status:
    """The status in a watch's cancel reason: etcd 3.4 writes ``rpc error: code =
    Unauthenticated desc = etcdserver: invalid auth token`` for an expired token (older
    releases wrote ``etcdserver: permission denied``)."""
    found = re.fullmatch(r"rpc error: code = (\w+) desc = (.*)", reason or "", re.DOTALL)
    if found is not None:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", found.group(1)).upper()  # PermissionDenied
        code = getattr(grpc.StatusCode, name, grpc.StatusCode.CANCELLED)
        return _Status(code, found.group(2))
    if "permission denied" in (reason or ""):
        return _Status(grpc.StatusCode.PERMISSION_DENIED, reason)
    return _Status(grpc.StatusCode.CANCELLED, reason or "etcd canceled the watch")


def _rpc_of(error: BaseException) -> Any:
    """The grpc error behind ``error`` (python3-etcd3 raises its own from inside
    ``except grpc.RpcError``, so the status is the ``__context__``), or None."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error
    context = error.__context__
    if isinstance(context, grpc.RpcError) and hasattr(context, "code"):
        return context
    return None


def _text(key: Any) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)


def _first_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if args:
        return _text(args[0])
    for name in ("key", "key_prefix", "range_start"):
        if name in kwargs:
            return _text(kwargs[name])
    return None


def _no_key(_args: tuple[Any, ...], _kwargs: dict[str, Any]) -> str | None:
    return None


def _txn_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    names = ("compare", "success", "failure")
    given = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
    keys: list[str] = []
    for name in names:
        for op in given.get(name) or ():
            key = getattr(op, "key", None)
            if key is not None and _text(key) not in keys:
                keys.append(_text(key))
    if not keys:
        return None
    return ", ".join(keys[:3]) + (" …" if len(keys) > 3 else "")


# -- the client -----------------------------------------------------------------------


def _reauthenticating(
    name: str, op: str, key_of: Callable[[tuple[Any, ...], dict[str, Any]], str | None]
) -> Any:
    """python3-etcd3's method ``name``, retried once after re-authenticating."""
    base = getattr(etcd3.MultiEndpointEtcd3Client, name)

    @functools.wraps(base)
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self._call(op, key_of(args, kwargs), base, self, *args, **kwargs)

    return method


_ELECTION = ("leader changed", "no leader", "not leader", "not capable")
_PATIENCE = 5.0  # seconds a call is retried while the etcd cluster elects a leader
_SKIP_FAILED = 2.0  # seconds a failed endpoint of a list is passed over
# gRPC's reconnect backoff (1 s, times 1.6 per failed attempt, up to 120 s) left a client
# blind for 5 s after a 20 s etcd outage (and longer after longer ones): capped at 1 s, every
# partq process reads etcd again within about a second of its return.
# (gRPC takes its min_reconnect_backoff as the shortest connect timeout too: left alone.)
_RECONNECT = [("grpc.max_reconnect_backoff_ms", 1000)]
# A stream's group is read with one range request (the status, `stream delete`, a leader's
# snapshot): at the top of the partition range (MAX_PARTITIONS) its assignment, claim and
# standby keys take about 22 MB, and up to about 110 MB with 253-character member ids and
# stream names, far over gRPC's default 4 MB (docs/benchmarks.md, "etcd reads of a large
# stream"). The limit is a ceiling on what one answer may hold, not a buffer.
_MAX_RECEIVE = 256 * 1024 * 1024
_CHANNEL = [*_RECONNECT, ("grpc.max_receive_message_length", _MAX_RECEIVE)]


def _retrying(fn: Callable[..., T], endpoints: int, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, retried when another try can succeed: while etcd answers
    UNAVAILABLE because its members elect a leader (a member died: the others need about a
    second; 0.1 s doubling, for at most ``_PATIENCE`` s), and once per other endpoint when
    the one in use cannot be reached (python3-etcd3 then moves to another, but does not
    retry the call itself). Any other error is raised at once."""
    deadline = time.monotonic() + _PATIENCE
    delay = 0.1
    switches = endpoints - 1
    while True:
        try:
            return fn(*args, **kwargs)
        except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as e:
            if isinstance(e, etcd3.exceptions.ConnectionFailedError) and switches > 0:
                switches -= 1
                continue
            rpc = _rpc_of(e)
            electing = (
                rpc is not None
                and rpc.code() == grpc.StatusCode.UNAVAILABLE
                and any(word in (rpc.details() or "") for word in _ELECTION)
            )
            if not electing or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


class Client(etcd3.MultiEndpointEtcd3Client):  # type: ignore[misc]
    """python3-etcd3's client that stays authenticated, one stream per watch.

    Built by :func:`connect`. Failures of the calls partq makes raise :class:`CallFailed`
    (an ``Etcd3Exception``) for :func:`etcd_errors` to translate.
    """

    def __init__(
        self,
        endpoints: list[Any],
        *,
        timeout: float | None,
        identity: Identity,
        password: str | None = None,
    ) -> None:
        self.identity = identity
        self._password = password
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        self._watches: dict[int, _WatchStream] = {}
        self._watch_ids = itertools.count(1)
        super().__init__(endpoints=endpoints, timeout=timeout, failover=True)
        if identity.user is not None:
            try:
                self._authenticate(stale=None, first=True)
            except BaseException:
                super().close()
                raise

    # The token goes with every call as metadata, read when the call is made. (No call
    # credentials: the token is the only credential; TLS is checked by connect().)
    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token
        return (("token", token),) if token else None

    @metadata.setter
    def metadata(self, _value: Any) -> None:
        """python3-etcd3's constructor sets None; the token is kept in ``_token``."""

    # -- authentication ----------------------------------------------------------------

    @etcd3.MultiEndpointEtcd3Client._handle_errors  # type: ignore[untyped-decorator]
    def _authenticate_rpc(self) -> Any:
        request = etcd3.etcdrpc.AuthenticateRequest(
            name=self.identity.user, password=self._password
        )
        return self.authstub.Authenticate(request, self.timeout)

    def _authenticate(self, stale: str | None, first: bool = False) -> None:
        """Get a new token, unless another thread already replaced ``stale``."""
        with self._auth_lock:
            if not first and self._token != stale:
                return
            try:
                response = self._authenticate_rpc()
            except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as e:
                rpc = _rpc_of(e)
                if rpc is None:
                    raise
                if (
                    rpc.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and "authentication is not enabled" in (rpc.details() or "")
                ):
                    if first:
                        log.warning(
                            "etcd has authentication disabled: %s is not used until it is "
                            "enabled", self.identity.who(),
                        )  # fmt: skip
                    self._token = None
                    return
                raise self._failed(rpc, "authenticate", None) from e
            self._token = response.token
            if not first:
                log.debug("etcd auth token renewed for %s", self.identity.who())

    def _stale_token(self, rpc: Any, *, watch: bool = False) -> bool:
        """Whether a new token may cure ``rpc``'s failure."""
        if self.identity.user is None:
            return False
        code, details = rpc.code(), rpc.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:  # "invalid auth token": expired
            return True
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return "revision of auth store is old" in details or "user name is empty" in details
        # a watch stream's token is checked at creation and reported as a denial
        return watch and code == grpc.StatusCode.PERMISSION_DENIED

    def _failed(self, rpc: Any, op: str, key: str | None) -> CallFailed:
        return CallFailed(rpc.code(), rpc.details() or "", self.identity, op, key)

    def _call(self, op: str, key: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``; after a stale-token failure, authenticate and retry once."""
        token = self._token
        watch = op == "watch"
        try:
            return _retrying(fn, len(self.endpoints), *args, **kwargs)
        except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as e:
            rpc = _rpc_of(e)
            if rpc is None:
                raise
            if not self._stale_token(rpc, watch=watch):
                raise self._failed(rpc, op, key) from e
        self._authenticate(stale=token)
        try:
            return _retrying(fn, len(self.endpoints), *args, **kwargs)
        except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as e:
            rpc = _rpc_of(e)
            if rpc is None:
                raise
            raise self._failed(rpc, op, key) from e

    def auth_rpc(self, name: str, request: Any, op: str) -> Any:
        """etcd's Auth service call ``name`` (``RoleAdd``, ``UserGrantRole``…) with our token."""

        def call() -> Any:
            return getattr(self.authstub, name)(request, self.timeout, metadata=self.metadata)

        return self._call(op, None, call)

    get_response = _reauthenticating("get_response", "read", _first_key)
    get_prefix_response = _reauthenticating("get_prefix_response", "read", _first_key)
    get_range_response = _reauthenticating("get_range_response", "read", _first_key)
    get_all_response = _reauthenticating("get_all_response", "read", _no_key)
    put = _reauthenticating("put", "write", _first_key)
    put_if_not_exists = _reauthenticating("put_if_not_exists", "write", _first_key)
    replace = _reauthenticating("replace", "write", _first_key)
    delete = _reauthenticating("delete", "delete", _first_key)
    delete_prefix = _reauthenticating("delete_prefix", "delete", _first_key)
    transaction = _reauthenticating("transaction", "run a transaction on", _txn_keys)
    status = _reauthenticating("status", "read the status", _no_key)
    lease = _reauthenticating("lease", "grant a lease", _no_key)
    revoke_lease = _reauthenticating("revoke_lease", "revoke a lease", _no_key)
    get_lease_info = _reauthenticating("get_lease_info", "read a lease", _no_key)
    compact = _reauthenticating("compact", "compact", _no_key)

    def refresh_lease(self, lease_id: int) -> Iterator[Any]:
        """One keep-alive round trip (``Lease.refresh`` and partq's sessions use this)."""
        base = super().refresh_lease
        responses = self._call("keep a lease alive", None, lambda: list(base(lease_id)))
        return iter(responses)

    # -- watches: one stream each ------------------------------------------------------

    def add_watch_callback(
        self,
        key: Any,
        callback: Callable[[Any], None],
        range_end: Any = None,
        start_revision: int | None = None,
        progress_notify: bool = False,
        filters: Any = None,
        prev_kv: bool = False,
    ) -> int:
        """Watch ``key`` (to ``range_end``); ``callback`` gets each response, then an error
        or ``None`` if the stream ends. Returns an id for :meth:`cancel_watch`."""
        create = etcd3.etcdrpc.WatchCreateRequest(key=etcd3.utils.to_bytes(key))
        if range_end is not None:
            create.range_end = etcd3.utils.to_bytes(range_end)
        if start_revision is not None:
            create.start_revision = start_revision
        if progress_notify:
            create.progress_notify = progress_notify
        if filters is not None:
            create.filters.extend(filters)
        if prev_kv:
            create.prev_kv = prev_kv
        request = etcd3.etcdrpc.WatchRequest(create_request=create)
        watch_id = next(self._watch_ids)
        shown = _text(key) + ("*" if range_end is not None else "")
        stream = self._call("watch", shown, self._open_watch, watch_id, request, callback, shown)
        with self._watch_lock:
            if not stream.ended:
                self._watches[watch_id] = stream
        return watch_id

    def _open_watch(
        self, watch_id: int, request: Any, callback: Callable[[Any], None], shown: str
    ) -> _WatchStream:
        stub = etcd3.etcdrpc.WatchStub(self.channel)
        stream = _WatchStream(
            stub.Watch, self.metadata, request, callback,
            failed=lambda rpc: self._failed(rpc, "watch", shown),
            ended=lambda: self._forget(watch_id), name=f"etcd-watch-{watch_id}",
        )  # fmt: skip
        stream.open(self.timeout)
        return stream

    def _forget(self, watch_id: int) -> None:
        with self._watch_lock:
            self._watches.pop(watch_id, None)

    def cancel_watch(self, watch_id: int) -> None:
        with self._watch_lock:
            stream = self._watches.pop(watch_id, None)
        if stream is not None:
            stream.cancel()

    def watch_once_response(self, key: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The first response on ``key``; a stream that ends first raises its error."""
        responses: queue.Queue[Any] = queue.Queue()
        watch_id = self.add_watch_callback(key, responses.put, **kwargs)
        try:
            response = responses.get(timeout=timeout)
        except queue.Empty:
            raise etcd3.exceptions.WatchTimedOut() from None
        finally:
            self.cancel_watch(watch_id)
        if isinstance(response, BaseException):
            raise response
        if response is None:
            raise etcd3.exceptions.ConnectionFailedError()
        return response

    def close(self) -> None:
        with self._watch_lock:
            streams = list(self._watches.values())
            self._watches.clear()
        for stream in streams:
            stream.cancel()
        super().close()


class _WatchStream:
    """One watch on its own gRPC stream (opened with the token of the moment).

    ``open`` waits for etcd to confirm the watch and raises what refused it; afterwards
    ``callback`` gets each response, and once, if etcd ends the stream, the error (a
    :class:`CallFailed`, ``RevisionCompactedError``) or ``None``. :meth:`cancel` ends it
    without a callback.
    """

    def __init__(
        self,
        watch: Callable[..., Any],
        metadata: Any,
        request: Any,
        callback: Callable[[Any], None],
        *,
        failed: Callable[[Any], CallFailed],
        ended: Callable[[], None],
        name: str,
    ) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests.put(request)
        self._callback = callback
        self._failed = failed
        self._on_end = ended
        self._created = threading.Event()
        self._stopped = threading.Event()
        self.failure: BaseException | None = None
        self.ended = False
        self._rpc = watch(iter(self._requests.get, None), metadata=metadata)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def open(self, timeout: float | None) -> None:
        self._thread.start()
        if not self._created.wait(timeout):
            self.cancel()
            raise etcd3.exceptions.WatchTimedOut()
        if self.failure is not None:
            self.cancel()
            raise self.failure

    def cancel(self) -> None:
        self._stopped.set()
        self._requests.put(None)
        self._rpc.cancel()

    def _run(self) -> None:
        end: BaseException | None = None
        try:
            for response in self._rpc:
                end = self._handle(response)
                if end is not None:
                    break
        except grpc.RpcError as e:
            end = e
        self._rpc.cancel()
        self.ended = True
        if not self._created.is_set():  # refused, or the stream failed, before creation
            self.failure = end if end is not None else etcd3.exceptions.ConnectionFailedError()
            self._created.set()
            return
        if self._stopped.is_set():  # canceled by us: nobody to tell
            return
        self._stopped.set()
        self._on_end()
        if isinstance(end, grpc.RpcError) and (rpc := _rpc_of(end)) is not None:
            end = self._failed(rpc)
        self._deliver(end)

    def _handle(self, response: Any) -> BaseException | None:
        """Deliver ``response``; or the error that ends this watch."""
        if response.compact_revision:
            compacted: BaseException = etcd3.exceptions.RevisionCompactedError(
                response.compact_revision
            )
            return compacted
        if response.canceled:
            return _cancel_status(response.cancel_reason)
        if response.created and not self._created.is_set():
            self._created.set()
        if response.events or not response.created:  # progress notifications too
            events = [etcd3.events.new_event(event) for event in response.events]
            self._deliver(etcd3.watch.WatchResponse(response.header, events))
        return None

    def _deliver(self, response: Any) -> None:
        try:
            self._callback(response)
        except Exception:
            log.exception("etcd watch callback failed")


# -- connecting -----------------------------------------------------------------------


def connect(settings: Settings) -> Client:
    """An etcd client for ``settings``, authenticated and checked with one status call."""
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
    if settings.etcd_user is not None and creds is None:
        raise UsageError(
            f"an etcd user and password need TLS, and {where} is plain http: use https:// "
            "endpoints and --etcd-ca (PARTQ_ETCD_CA) so the password and tokens are encrypted"
        )
    # A failed endpoint is skipped for _SKIP_FAILED seconds, so the client moves on to the
    # next of a list (python3-etcd3's default is 300 s); a single endpoint is never skipped.
    skip = _SKIP_FAILED if len(settings.endpoints) > 1 else 0.0
    endpoints = [
        etcd3.Endpoint(
            host, port, secure=creds is not None, creds=creds, time_retry=skip, opts=_CHANNEL
        )
        for host, port, _tls in settings.endpoints
    ]
    identity = Identity(
        user=settings.etcd_user,
        ca=str(settings.etcd_ca) if creds is not None else None,
        cert=str(settings.etcd_cert) if settings.etcd_cert is not None else None,
    )
    password = settings.etcd_password.get_secret_value() if settings.etcd_password else None
    with etcd_errors(where):
        client = Client(
            endpoints, timeout=settings.etcd_timeout, identity=identity, password=password
        )
        try:
            client.status()
        except BaseException:
            client.close()
            raise
    return client


# -- errors ---------------------------------------------------------------------------


@contextmanager
def etcd_errors(where: str) -> Iterator[None]:
    """Translate etcd3/grpc errors raised inside into an :class:`EtcdError` (see
    :func:`translate`)."""
    try:
        yield
    except (etcd3.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as e:
        if isinstance(e, ValueError) and "failed node" not in str(e):
            raise
        raise translate(e, where) from None


_CLIENT_CERT_REFUSED = (
    "TSI_DATA_CORRUPTED",  # TLS 1.3: etcd's alert arrives after our side of the handshake
    "BAD_CERTIFICATE",
    "CERTIFICATE_REQUIRED",
    "UNKNOWN_CA",
    "CERTIFICATE_UNKNOWN",
    "CERTIFICATE_EXPIRED",
)
_NO_TLS_THERE = ("Handshake read failed", "WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG")


def translate(error: BaseException, where: str) -> EtcdError:
    """One line for what went wrong talking to etcd at ``where``."""
    if isinstance(error, CallFailed):
        code, details, identity = error.code, error.details, error.identity
        op, key = error.op, error.key
    else:
        rpc = _rpc_of(error)
        code = rpc.code() if rpc is not None else None
        details = (rpc.details() or "") if rpc is not None else (str(error) or type(error).__name__)
        identity, op, key = Identity(), "", None
    detail = f"{code.name if code is not None else type(error).__name__}: {details}"
    user = identity.user

    # etcd answers OUT_OF_RANGE both for a compacted and for a future revision: the
    # details tell them apart (etcdserver's ErrCompacted); a watch says so in its response.
    if isinstance(error, etcd3.exceptions.RevisionCompactedError) or (
        code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details
    ):
        return EtcdCompacted(
            f"etcd at {where} has compacted away the revision asked for ({detail}): "
            "read the current state again"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
        return EtcdAuthFailed(
            f"etcd at {where}: authentication failed for user {user!r}: wrong user name or "
            "password (--etcd-user or PARTQ_ETCD_USER, and PARTQ_ETCD_PASSWORD)"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in details:
        hint = (
            f" (a client certificate names the user only where etcd runs with "
            f"--client-cert-auth; {identity.cert} was sent)"
            if identity.cert is not None
            else ""
        )
        return EtcdAuthFailed(
            f"etcd at {where} requires authentication: set --etcd-user and PARTQ_ETCD_PASSWORD, "
            f"or --etcd-cert/--etcd-key with a certificate whose CN is an etcd user{hint}"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.INVALID_ARGUMENT and "auth store is old" in details
    ):
        return EtcdAuthFailed(
            f"etcd at {where} refused the auth token of {identity.who()} even after "
            f"authenticating again ({detail})"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        what = f"{op} {key}" if op and key else (op or "do this")
        return EtcdPermissionDenied(
            f"etcd at {where}: permission denied: {identity.who()} may not {what}: "
            f"{_narrow_right(op, key)}"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        tls = _tls_problem(details, identity, where)
        if tls is not None:
            return tls
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _exhausted(details, where, f"{op} {key}" if op and key else op or "a call")
    return EtcdUnavailable(
        f"cannot reach etcd at {where}: is it running? (set PARTQ_ETCD_ENDPOINTS or "
        f"--etcd-endpoints) ({detail})"
    )


def _exhausted(details: str, where: str, what: str) -> EtcdError:
    """RESOURCE_EXHAUSTED: an answer over the client's receive limit, etcd out of space
    (its NOSPACE alarm) or etcd shedding load; etcd itself is reachable."""
    size = re.search(r"larger than max \((\d+) vs\. (\d+)\)", details)
    if size is not None:
        prefix = what.split(" ", 1)[-1] if " " in what else "the prefix"
        return EtcdError(
            f"etcd at {where} answered {what} with {size.group(1)} bytes, more than the "
            f"{size.group(2)} this partq accepts: count the keys there with `etcdctl get "
            f"--prefix --keys-only {prefix} | wc -l` and delete those partq did not write"
        )
    if "space exceeded" in details:
        return EtcdError(
            f"etcd at {where} is out of space ({details}): compact and defragment it, then "
            "`etcdctl alarm disarm` (or raise its --quota-backend-bytes)"
        )
    return EtcdUnavailable(f"etcd at {where} is overloaded and refused {what} ({details})")


def _narrow_right(op: str, key: str | None) -> str:
    """What to grant for ``op`` on ``key``, and no more: the key itself, with the
    permission the operation needs (a watch of ``…/*`` needs read on that prefix)."""
    if key is None or ", " in key or key.endswith(" …"):
        keys = f" on {key}" if key else ""
        return (
            f"use an etcd user whose role allows it{keys}; `partq security roles STREAM` "
            "prints each component's rights"
        )
    permission = (
        "read" if op in ("read", "watch") else "readwrite" if "transaction" in op else "write"
    )
    prefix = key.endswith("*")
    target = key.removesuffix("*")
    flag = " --prefix=true" if prefix else ""
    return (
        f"grant its role {permission} on {'the prefix ' if prefix else ''}{target} "
        f"(etcdctl role grant-permission ROLE{flag} {permission} {target}), or use the "
        "role `partq security roles STREAM` prints for this component"
    )


def _tls_problem(details: str, identity: Identity, where: str) -> EtcdError | None:
    if "CERTIFICATE_VERIFY_FAILED" in details:
        found = re.search(r"CERTIFICATE_VERIFY_FAILED:?\s*([^:()]*)", details)
        reason = found.group(1).strip() if found and found.group(1).strip() else "unverified"
        return EtcdTLSError(
            f"etcd at {where}: its server certificate is not trusted by the CA file "
            f"{identity.ca} (--etcd-ca or PARTQ_ETCD_CA): {reason}"
        )
    if "Hostname Verification" in details or "not in peer certificate" in details:
        return EtcdTLSError(
            f"etcd at {where}: its server certificate does not name the host in "
            "--etcd-endpoints (use a name or address in its subject alternative names)"
        )
    if identity.ca is not None and any(s in details for s in _CLIENT_CERT_REFUSED):
        if identity.cert is None:
            return EtcdTLSError(
                f"etcd at {where} requires a client certificate: set --etcd-cert and "
                "--etcd-key (PARTQ_ETCD_CERT, PARTQ_ETCD_KEY)"
            )
        return EtcdTLSError(
            f"etcd at {where} refused the client certificate {identity.cert}: it must be "
            "signed by a CA in etcd's --trusted-ca-file, current, and for client auth"
        )
    if identity.ca is not None and any(s in details for s in _NO_TLS_THERE):
        return EtcdTLSError(
            f"etcd at {where} does not speak TLS: use http:// endpoints, or serve TLS there"
        )
    if identity.ca is None and "Socket closed" in details:
        return EtcdUnavailable(
            f"etcd at {where} closed the connection: if it serves TLS, use https:// endpoints "
            f"and --etcd-ca (PARTQ_ETCD_CA) ({details})"
        )
    return None


# -- transactions ---------------------------------------------------------------------


class _LeaseCompare(etcd3.transactions.BaseCompare):  # type: ignore[misc]
    """``Compare(key).lease == id`` — python3-etcd3 has no helper for the LEASE target."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcd3.etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def lease_is(key: str, lease_id: int) -> Any:
    """A transaction comparison that holds while ``key`` is attached to ``lease_id``."""
    return _LeaseCompare(key) == lease_id
