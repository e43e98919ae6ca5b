"""A session: an etcd lease kept alive by a refresher thread for the life of a client.

Like etcd's Go ``concurrency.Session``: ``lost`` is set when etcd says the
lease is gone (expired or revoked). An etcd that cannot be *reached* does not
end the session: nobody can take our partitions while etcd is down, and where
etcd is up for others the broker's single-active-consumer keeps a new owner
waiting until we stop. :meth:`fresh` tells whether the refresher has run
recently, which is false right after the process was frozen (SIGSTOP): a
consumer waits for the next refresh before handling more messages. An etcd that
*refuses* the renewal (:class:`partq.kernel.errors.EtcdRefused`: the user's password or
certificate no longer accepted) will refuse every later one, and the lease then runs
out unseen: the session counts as lost at once, so its owner stops and rejoins,
where the same refusal ends it with its line.

Threads. The keepalive thread (``lease-<id>``) calls :meth:`renew` every ``ttl / 3``
seconds; the owner may call it too (a consumer after a freeze), so two renewals can run
at once. ``_ticked`` (a condition) guards ``last_tick``, wakes :meth:`wait_fresh`'s
waiters (worker threads) and makes ``lost`` be set, and ``on_lost`` called, once;
:meth:`fresh` reads ``last_tick`` without it (one float). ``on_lost`` and
``on_renewal_failure`` run on whichever thread renewed: they must be quick and
thread-safe (the daemon and the coordinator queue an event). :meth:`close`, on the
owner's thread, sets ``_closed``, revokes the lease and joins the keepalive thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from partq.kernel.errors import EtcdError, retryable
from partq.kernel.etcd import EtcdClient, etcd_errors

__all__ = ["Session"]

log = logging.getLogger("partq.session")


class Session:
    def __init__(
        self,
        client: EtcdClient,
        where: str,
        ttl: int = 5,
        *,
        on_lost: Callable[[], None] | None = None,
        on_renewal_failure: Callable[[], None] | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 s, got {ttl}")
        self.client = client
        self.where = where
        self.ttl = ttl
        self.interval = ttl / 3
        self.lost = threading.Event()
        self._closed = threading.Event()
        self._ticked = threading.Condition()
        self._on_lost = on_lost
        self._on_failure = on_renewal_failure
        with etcd_errors(where):
            self.lease = client.lease(ttl)
        self.id: int = self.lease.id
        self.last_tick = time.monotonic()
        self._thread = threading.Thread(
            target=self._refresh, name=f"lease-{self.id:x}", daemon=True
        )
        self._thread.start()

    def _refresh(self) -> None:
        while not self._closed.wait(self.interval):
            self.renew()
            if self.lost.is_set():
                return

    def renew(self) -> None:
        """Renew the lease now (the refresher does every interval; a consumer that was
        frozen asks at once, before acting on what it missed). Sets ``lost`` if etcd says
        the lease is gone or refuses to renew it; an etcd that does not answer is logged
        and counted."""
        started = time.monotonic()
        try:
            with etcd_errors(self.where):
                responses = list(self.client.refresh_lease(self.id))
            remaining = responses[0].TTL if responses else 0
        except EtcdError as e:
            if self._on_failure:
                self._on_failure()
            if retryable(e):
                log.warning("cannot renew lease %x: %s", self.id, e)
                remaining = None
            else:  # every later renewal is refused too: the lease runs out unseen
                log.error("lease %x counts as lost: etcd refuses to renew it: %s", self.id, e)
                remaining = 0
        if remaining is not None and remaining <= 0:
            # lost before the tick: a waiter woken by it must not take it for a renewal
            log.warning("lease %x is gone (expired, revoked, or refused)", self.id)
            self._lose()
        with self._ticked:
            self.last_tick = max(self.last_tick, started)
            self._ticked.notify_all()

    def _lose(self) -> None:
        with self._ticked:  # the refresher and renew() may find it at once: tell once
            if self.lost.is_set():
                return
            self.lost.set()
        if self._on_lost:
            self._on_lost()

    def fresh(self) -> bool:
        """True while the refresher ran within the last two intervals."""
        return time.monotonic() - self.last_tick < 2 * self.interval + 0.5

    def wait_fresh(self, timeout: float) -> bool:
        """After a freeze, wait for the refresher's next run; False if the lease is lost."""
        deadline = time.monotonic() + timeout
        with self._ticked:
            while not self.fresh() and not self.lost.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ticked.wait(left)
        return not self.lost.is_set() and self.fresh()

    def close(self, *, revoke: bool = True) -> None:
        """Stop refreshing; revoke so that our keys vanish now instead of after a TTL."""
        self._closed.set()
        if revoke and not self.lost.is_set():
            try:
                with etcd_errors(self.where):
                    self.client.revoke_lease(self.id)
            except EtcdError as e:
                log.warning(
                    "could not revoke lease %x (it expires in %ss): %s", self.id, self.ttl, e
                )
        self._thread.join(timeout=self.interval + 1)
