"""The RabbitMQ edge shared by every component: URLs, connection set-up, error translation.

A connection is described by an :class:`AmqpTarget`: the URL (which holds the
user and password) and its :class:`AmqpTLS` settings (CA, client certificate,
EXTERNAL auth). The URL may be a list, comma-separated (``amqp://a:5672/,amqp://b:5672/``,
each entry with its own user and password; the TLS settings apply to every ``amqps://``
one): :class:`Nodes` connects to the first that answers and, when a connection is lost,
goes on with the next, as Kafka clients use a bootstrap list.
:class:`partq.kernel.settings.Settings` builds the target (``settings.amqp``); every component
passes it, unchanged, to this module. A plain URL string is accepted where a target is,
with no TLS settings of its own.

``amqps://`` always verifies the server: its certificate must be signed by the
CA file (``PARTQ_AMQP_CA``) or, without one, by the system store, and must name
the host of the URL.

pika's connection errors, and the ``ssl`` errors it lets through, are translated
here into :mod:`partq.kernel.errors`, one line per cause: authentication failed, a
certificate not trusted, a hostname mismatch, a client certificate required or
refused, permission denied, not reachable.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pika
import pika.credentials
import pika.exceptions

from partq.kernel.errors import BrokerRefused, BrokerUnavailable, UsageError

__all__ = [
    "DEFAULT_AMQP_URL",
    "AmqpTLS",
    "AmqpTarget",
    "AmqpURL",
    "Nodes",
    "abort_connection",
    "access_refused",
    "blocking_connection",
    "connect_blocking",
    "connection_parameters",
    "has_password",
    "redact_url",
    "target",
    "targets",
    "unavailable",
    "with_password",
]

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
# basic.qos prefetch_count is a 16-bit field: RabbitMQ cannot take a larger prefetch
MAX_PREFETCH = 65_535

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


@dataclass(frozen=True)
class AmqpTLS:
    """TLS settings of an ``amqps://`` connection (none of them needed for ``amqp://``)."""

    ca: Path | None = None  # trusted CA file; None: the system store
    cert: Path | None = None  # client certificate (with ``key``)
    key: Path | None = None
    external_auth: bool = False  # authenticate by the client certificate (SASL EXTERNAL)

    @property
    def configured(self) -> bool:
        return self != AmqpTLS()

    def trusted(self) -> str:
        """Where trust comes from, for messages."""
        return f"the CA file {self.ca} (PARTQ_AMQP_CA)" if self.ca else "the system store"


@dataclass(frozen=True)
class AmqpTarget:
    """A RabbitMQ URL and its TLS settings; prints with the password hidden."""

    url: str = field(repr=False)
    tls: AmqpTLS = AmqpTLS()

    def __str__(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"AmqpTarget(url={redact_url(self.url)!r}, tls={self.tls!r})"


AmqpURL = str | AmqpTarget


def target(url: AmqpURL) -> AmqpTarget:
    return url if isinstance(url, AmqpTarget) else AmqpTarget(url)


# a comma before a scheme (or another comma, or the end) separates entries: one inside a password
# does not
_LIST = re.compile(r"\s*,(?=[\s,]*(?:amqps?://|$))\s*")


def targets(url: AmqpURL) -> list[AmqpTarget]:
    """The entries of a comma-separated URL list (one entry for a single URL)."""
    where = target(url)
    entries = [u.strip() for u in _LIST.split(where.url.strip())]
    if len(entries) > 1 and not all(entries):
        raise UsageError(f"the AMQP URL list {redact_url(where.url)!r} has an empty entry")
    return [AmqpTarget(u, where.tls) for u in entries]


@dataclass
class Nodes:
    """The nodes of a URL list, each with its pika parameters; :meth:`advance` moves on
    (round robin) after a failed attempt or a lost connection."""

    targets: list[AmqpTarget]
    params: list[pika.URLParameters]
    index: int = 0

    @classmethod
    def of(
        cls,
        url: AmqpURL,
        *,
        name: str,
        heartbeat: int | None = None,
        socket_timeout: float | None = None,
    ) -> Nodes:
        found = targets(url)
        params = [connection_parameters(t, name=name, heartbeat=heartbeat) for t in found]
        for p in params:
            p.connection_attempts = 1
            if socket_timeout is not None:
                p.socket_timeout = socket_timeout
        return cls(found, params)

    @property
    def current(self) -> pika.URLParameters:
        return self.params[self.index]

    @property
    def where(self) -> AmqpTarget:
        return self.targets[self.index]

    def advance(self) -> None:
        self.index = (self.index + 1) % len(self.params)


# -- URLs -------------------------------------------------------------------------------


def _split(url: str) -> tuple[str, str | None, str] | None:
    """``scheme``, the userinfo (all before the LAST ``@``; None without one), the rest.

    Splitting at the last ``@`` keeps a password with an unencoded ``@ / ? #`` in the
    userinfo, where :func:`urllib.parse.urlsplit` would cut it into the path.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return None
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return scheme, None, rest
    return scheme, userinfo, host


def _hostless_secret(rest: str) -> bool:
    """``u:pw`` (no ``@``): a ``:`` not followed by a port number may be a password."""
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if authority.startswith("["):  # [IPv6]:port
        port = authority.partition("]")[2].removeprefix(":")
    elif ":" in authority:
        port = authority.rpartition(":")[2]
    else:
        return False
    return not port.isdigit() and port != ""


def redact_url(url: str | AmqpTarget) -> str:
    """``url`` with its password replaced by ``***``, for logs and errors.

    Never returns the password, whatever the URL's shape: what cannot be parsed
    prints as ``amqp://***`` (``SCHEME://***`` for another scheme).
    """
    if isinstance(url, AmqpTarget):
        url = url.url
    entries = _LIST.split(url.strip())
    if len(entries) > 1:
        return ",".join(redact_url(entry) for entry in entries)
    split = _split(url)
    if split is None:
        return "amqp://***"
    scheme, userinfo, rest = split
    if userinfo is None:
        return f"{scheme}://***" if _hostless_secret(rest) else url
    user, colon, _password = userinfo.partition(":")
    if not colon:  # a user name alone (or an "@" past the authority: no userinfo)
        return url
    return f"{scheme}://{user}:***@{rest}"


def has_password(url: str) -> bool:
    """Whether ``url`` carries a password (or might: ``amqp://u:pw`` with no host)."""
    entries = _LIST.split(url.strip())
    if len(entries) > 1:
        return any(has_password(entry) for entry in entries)
    split = _split(url)
    if split is None:
        return True  # not a URL: assume the worst
    _scheme, userinfo, rest = split
    if userinfo is None:
        return _hostless_secret(rest)
    return ":" in userinfo


def with_password(url: str, password: str) -> str:
    """``url`` (with a user and no password) with ``password`` percent-encoded into it; in
    a list, into every entry that names a user without a password."""
    entries = _LIST.split(url.strip())
    if len(entries) > 1:
        return ",".join(with_password(e, password) if _needs_password(e) else e for e in entries)
    split = _split(url)
    if split is None or split[1] is None or re.search(r"[/?#]", split[1]):
        raise UsageError(
            f"a password file needs the user in the AMQP URL, "
            f"e.g. amqp://USER@HOST:5672/%2F (got {redact_url(url)!r})"
        )
    scheme, userinfo, rest = split
    if userinfo is not None and ":" in userinfo:
        raise UsageError(
            f"the AMQP URL {redact_url(url)!r} already holds a password: "
            "give it there or in PARTQ_AMQP_PASSWORD_FILE, not both"
        )
    return f"{scheme}://{userinfo}:{quote(password, safe='')}@{rest}"


def _needs_password(url: str) -> bool:
    split = _split(url)
    return split is not None and split[1] is not None and ":" not in split[1]


def _check_encoding(url: str) -> None:
    split = _split(url)
    if split is None or split[1] is None:
        return
    try:
        netloc = urlsplit(url).netloc
    except ValueError as e:  # e.g. an unclosed "[" of an IPv6 host
        raise UsageError(f"bad AMQP URL {redact_url(url)!r}: {e}") from None
    if "@" not in netloc:  # the userinfo holds a raw / ? or #
        raise UsageError(
            f"the user or password in the AMQP URL {redact_url(url)!r} must be "
            "percent-encoded (/ as %2F, ? as %3F, # as %23, @ as %40, : as %3A, % as %25)"
        )


# -- connecting -------------------------------------------------------------------------


def _ssl_context(tls: AmqpTLS) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"cannot load the AMQP CA file {tls.ca} (PARTQ_AMQP_CA): {e}") from None
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    if tls.cert is not None:
        try:
            context.load_cert_chain(str(tls.cert), str(tls.key) if tls.key else None)
        except (OSError, ssl.SSLError) as e:
            raise UsageError(
                f"cannot load the AMQP client certificate {tls.cert} and key {tls.key} "
                f"(PARTQ_AMQP_CERT, PARTQ_AMQP_KEY): {e}"
            ) from None
    return context


def connection_parameters(
    url: AmqpURL, *, name: str, heartbeat: int | None = None
) -> pika.URLParameters:
    """pika parameters for ``url`` (one URL; :class:`Nodes` for a list): TLS as its
    settings say, verified, with our name."""
    where = target(url)
    if len(targets(where)) > 1:
        raise UsageError(f"one AMQP URL is needed here, not the list {redact_url(where.url)!r}")
    text, tls = where.url, where.tls
    if not text.startswith(("amqp://", "amqps://")):
        raise UsageError(
            f"AMQP URL {redact_url(text)!r} must start with amqp:// or amqps://, "
            f"e.g. {DEFAULT_AMQP_URL!r}"
        )
    _check_encoding(text)
    secure = text.startswith("amqps://")
    if tls.configured and not secure:
        raise UsageError(
            f"AMQP TLS settings (PARTQ_AMQP_CA/CERT/KEY/EXTERNAL_AUTH) are set but the URL "
            f"{redact_url(text)!r} is amqp://: use amqps://"
        )
    try:
        params = pika.URLParameters(text)
    except Exception as e:  # pika raises ValueError and friends for bad query strings
        raise UsageError(f"bad AMQP URL {redact_url(text)!r}: {e}") from None
    if secure and (tls.configured or "ssl_options" not in urlsplit(text).query):
        host = urlsplit(text).hostname or params.host
        params.ssl_options = pika.SSLOptions(_ssl_context(tls), server_hostname=host)
    if tls.external_auth:
        params.credentials = pika.credentials.ExternalCredentials()
    params.client_properties = {"connection_name": name, "product": "partq"}
    if heartbeat is not None:
        params.heartbeat = heartbeat
    params.blocked_connection_timeout = 60
    return params


# -- errors -----------------------------------------------------------------------------

_CLIENT_CERT_ALERTS = ("CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE")
_CLIENT_CERT_REFUSED = ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "EXPIRED")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, what it wraps (pika keeps the cause in ``args``) and its causes."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(a for a in e.args if isinstance(a, BaseException))
        inner = getattr(e, "exception", None)  # pika's AMQPConnectorException wrappers
        if isinstance(inner, BaseException):
            todo.append(inner)
        todo.extend(getattr(e, "exceptions", ()))  # AMQPConnectionWorkflowFailed
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)


def unavailable(url: AmqpURL, error: BaseException) -> BrokerUnavailable:
    """One line saying why RabbitMQ at ``url`` could not be used, and what to set."""
    failure = _Failure(target(url), tuple(_chain(error)), type(error).__name__)
    refused = _refused(failure)
    if refused is not None:
        return BrokerRefused(refused)
    why = _untrusted(failure) or _tls_failed(failure)
    return BrokerUnavailable(
        why
        or f"cannot reach {failure.at}: is it running? (set PARTQ_AMQP_URL or --amqp-url) "
        f"({failure.detail})"
    )


@dataclass(frozen=True)
class _Failure:
    """A failure to use RabbitMQ at ``where``: the error and everything it wraps."""

    where: AmqpTarget
    chain: tuple[BaseException, ...]
    name: str  # the outer error's type

    @property
    def at(self) -> str:
        return f"RabbitMQ at {redact_url(self.where.url)}"

    @property
    def text(self) -> str:
        return " ".join(str(e) for e in self.chain) or self.name

    @property
    def detail(self) -> str:
        """The first that says something, past pika's workflow wrappers."""
        return next((str(e) for e in self.chain if str(e) and not _is_wrapper(e)), self.name)

    def found(self, kind: type[BaseException]) -> BaseException | None:
        return next((e for e in self.chain if isinstance(e, kind)), None)


def _untrusted(f: _Failure) -> str | None:
    """RabbitMQ's server certificate failed verification."""
    e = f.found(ssl.SSLCertVerificationError)
    if not isinstance(e, ssl.SSLCertVerificationError):
        return None
    if "Hostname mismatch" in str(e) or "IP address mismatch" in str(e):
        return (
            f"{f.at}: its server certificate does not name the host "
            f"{urlsplit(f.where.url).hostname!r} of the URL: connect by a name the "
            f"certificate holds ({e.verify_message})"
        )
    return (
        f"{f.at}: its server certificate is not trusted by {f.where.tls.trusted()}: "
        f"{e.verify_message} (set PARTQ_AMQP_CA to the CA that signed it)"
    )


def _refused(f: _Failure) -> str | None:
    """RabbitMQ refused the user: its login, the virtual host, or a resource."""
    if f.found(pika.exceptions.ProbableAuthenticationError) or (
        "ACCESS_REFUSED - Login was refused" in f.text
    ):
        if f.where.tls.external_auth:
            how = "check the client certificate (EXTERNAL auth: its CN must be a RabbitMQ user)"
            return f"{f.at}: authentication failed: {how}"
        user = unquote(urlsplit(f.where.url).username or "guest")  # pika's default user
        return (
            f"{f.at}: authentication failed: RabbitMQ refused the login of user {user!r}: "
            "check the user and password in PARTQ_AMQP_URL (or PARTQ_AMQP_PASSWORD_FILE)"
        )
    if f.found(pika.exceptions.AuthenticationError):
        return f"{f.at}: authentication failed: {f.detail}"
    if f.found(pika.exceptions.ProbableAccessDeniedError):
        vhost = unquote(urlsplit(f.where.url).path[1:] or "/")
        return (
            f"{f.at}: permission denied on the virtual host {vhost!r}: it must exist and "
            f"the user needs permissions on it ({_reply_text(f.text)})"
        )
    closed = f.found(pika.exceptions.ChannelClosedByBroker)
    if isinstance(closed, pika.exceptions.ChannelClosedByBroker) and closed.reply_code == 403:
        return access_refused(f.where, closed.reply_text)
    return None


def _tls_failed(f: _Failure) -> str | None:
    """The TLS handshake failed: a client certificate wanted or refused, or no TLS there."""
    upper, secure, cert = f.text.upper(), f.where.url.startswith("amqps://"), f.where.tls.cert
    if any(alert in upper for alert in _CLIENT_CERT_ALERTS) and cert is None:
        return (
            f"{f.at} requires a client certificate: set PARTQ_AMQP_CERT and PARTQ_AMQP_KEY "
            f"(--amqp-cert, --amqp-key) ({f.detail})"
        )
    if any(alert in upper for alert in (*_CLIENT_CERT_REFUSED, *_CLIENT_CERT_ALERTS)):
        return (
            f"{f.at} refused the client certificate {cert}: it must be signed by a "
            f"CA RabbitMQ trusts (its ssl_options.cacertfile) and be current ({f.detail})"
        )
    if secure and ("SSLEOFError" in f.text or "EOF occurred" in f.text):
        # TLS 1.3: the server's alert can lose the race with our first write, which then
        # meets a closed connection instead of the alert's reason
        if cert is None:
            return (
                f"{f.at} closed the TLS connection: it probably requires a client "
                "certificate: set PARTQ_AMQP_CERT and PARTQ_AMQP_KEY (--amqp-cert, "
                f"--amqp-key) ({f.detail})"
            )
        return (
            f"{f.at} closed the TLS connection: it probably refused the client certificate "
            f"{cert}: it must be signed by a CA RabbitMQ trusts and be current ({f.detail})"
        )
    if f.found(ssl.SSLError) or "SSLError" in f.text:
        return (
            f"{f.at}: TLS failed: is this port a TLS listener (amqps://, usually 5671)? "
            f"({f.detail})"
        )
    if not secure and f.found(pika.exceptions.IncompatibleProtocolError):
        return (
            f"{f.at}: the connection was dropped at the protocol header: is this a TLS "
            f"port (then use amqps://)? ({f.detail})"
        )
    return None


# RabbitMQ 3.10 leaves the permission out ("access to queue …"); later ones name it
_REFUSED = re.compile(
    r"(?:(configure|write|read) )?access to (\w+) '(.*)' in vhost '(.*)' refused for user '(.*)'"
)


def access_refused(url: AmqpURL, reply_text: str, permission: str | None = None) -> str:
    """One line for RabbitMQ's 403 ACCESS_REFUSED on a queue or exchange: who may not do
    what to which, and the permission to grant. ``permission``: what the refused call
    needs (``read`` for basic.consume), when the broker's text does not say."""
    at = f"RabbitMQ at {redact_url(target(url).url)}"
    found = _REFUSED.search(reply_text)
    if found is None:
        return f"{at}: permission denied: {reply_text}: check the user's permissions"
    said, kind, name, vhost, user = found.groups()
    permission = said or permission
    grant = f"{permission} permission" if permission else "the configure, write and read it needs"
    return (
        f"{at}: permission denied: user {user!r} may not {permission or 'use'} {kind} {name!r} "
        f"in vhost {vhost!r}: grant it {grant} on that name, e.g. rabbitmqctl set_permissions "
        f"-p {vhost} {user} '^partq\\.' '^partq\\.' '^partq\\.' (configure, write, read) "
        f"({reply_text})"
    )


def _is_wrapper(error: BaseException) -> bool:
    return type(error).__module__ == "pika.adapters.utils.connection_workflow"


def _reply_text(text: str) -> str:
    found = re.search(r"\(\d+\) '([^']*)'", text)
    return found.group(1) if found else text


def connect_blocking(url: AmqpURL, *, name: str = "partq-admin") -> pika.BlockingConnection:
    """A ``BlockingConnection`` to the first node of ``url`` that answers (one attempt
    each, 5 s socket timeout); the caller closes it."""
    nodes = Nodes.of(url, name=name, socket_timeout=5)
    errors: list[str] = []
    for where, params in zip(nodes.targets, nodes.params, strict=True):
        try:
            return pika.BlockingConnection(params)
        except (pika.exceptions.AMQPError, ssl.SSLError, OSError) as e:
            if len(nodes.targets) == 1:
                raise unavailable(where, e) from None
            errors.append(str(unavailable(where, e)))
    raise BrokerUnavailable(f"no RabbitMQ node of the list answered: {'; '.join(errors)}")


@contextmanager
def blocking_connection(
    url: AmqpURL, *, name: str = "partq-admin"
) -> Iterator[pika.BlockingConnection]:
    connection = connect_blocking(url, name=name)
    try:
        yield connection
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 403:  # ACCESS_REFUSED on a queue or exchange: name it
            raise unavailable(url, e) from None
        raise
    finally:
        if connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()


def abort_connection(connection: Any, *, close: bool = False) -> None:
    """Drop ``connection``'s TCP stream (a pika connection, asynchronous or a blocking one's
    ``_impl``) without an AMQP close, as a kill -9 would: ``shutdown`` sends the broker a FIN
    at once, and pika, reading EOF, reports the connection lost and closes the socket.
    ``close``: close the socket too (its I/O loop is gone, so pika never will)."""
    sock = getattr(getattr(connection, "_transport", None), "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        if close:
            sock.close()
