"""A consumer's link to RabbitMQ: it joins its group only once RabbitMQ works, and leaves
while RabbitMQ is unusable.

A consumer is a member only while it can consume: it joins the group once its RabbitMQ
connection works and a channel takes its prefetch (not before: with a wrong password it
would hold partitions it cannot read). When RabbitMQ is unusable for longer than the AMQP
outage limit (``amqp_outage_limit``, the setting ``PARTQ_AMQP_OUTAGE_LIMIT``, 30 s by
default), it leaves the group so its partitions move, and rejoins once RabbitMQ works
again; ``/readyz`` is false meanwhile.

Planned handoffs by consumer priority are chosen on each connection, before joining, as
the broker's version and the setting allow (``_choose_handoff``).

:class:`BrokerLink` is a base class of :class:`partq.consumers.control.daemon.Consumer`.
Threads: its methods run on the daemon's controller thread, which alone reads and writes
``away``, ``_broker_up`` and ``_outages``; the broker's connection state reaches it as a
queued ``Connection`` event, and the outage limit as a deadline (``BrokerOutage``).
"""

from __future__ import annotations

import logging

from partq.consumers.control.consumerstate import ConsumerState
from partq.consumers.control.events import BrokerOutage
from partq.consumers.state.priority import switches

__all__ = ["BrokerLink"]

log = logging.getLogger("partq.consumer")


class BrokerLink(ConsumerState):
    """Joining and leaving as RabbitMQ works or not (the module docstring)."""

    def _on_broker(self, up: bool) -> None:
        """Join once the broker works; leave when it has not for the outage limit."""
        was, self._broker_up = self._broker_up, up
        if up and self.away:
            self._join_when_usable()
        elif up:
            self.partitions.resubscribe()
        elif was and not self.away:
            self._outages += 1
            self._after(self.config.amqp_outage_limit, BrokerOutage(self._outages))
        self._update_ready()

    def _join_when_usable(self) -> None:
        """Join now if the broker works (and we are not stopping or without the stream);
        else stay away: :meth:`_on_broker` joins once it works."""
        if self.stopping or self.deleted:
            return
        if not self.broker.connected.is_set():
            self.away = True
            return
        self.away = False
        self._choose_handoff()
        self._join()

    def _choose_handoff(self) -> None:
        """Hand partitions over by consumer priority if the setting allows it and the broker
        we are connected to switches (``partq.consumers.state.priority``); our member key says
        so."""
        version = self.broker.server_version
        by_priority = self.config.handoff == "auto" and switches(version, self.spec.queue_type)
        if by_priority != self.partitions.priority:
            log.info(
                "planned handoffs: %s (RabbitMQ %s, %s queues, handoff %s)",
                "by consumer priority" if by_priority else "by drain",
                version or "unknown",
                self.spec.queue_type,
                self.config.handoff,
            )
        self.partitions.priority = by_priority

    def _leave_for_broker(self, outage: int) -> None:
        """RabbitMQ has been unusable for the outage limit (since its ``outage``-th loss):
        our partitions stall here, so leave the group (they move to members that can
        consume them) until it works again."""
        if outage != self._outages or self._broker_up:
            return  # an earlier outage's timer, or the broker is back
        if self.away or self.stopping or self.deleted or self.membership.session is None:
            return
        log.warning(
            "RabbitMQ unusable for %gs (the AMQP outage limit, PARTQ_AMQP_OUTAGE_LIMIT): "
            "leaving the group so its partitions move; rejoining once it works",
            self.config.amqp_outage_limit,
        )
        self.away = True
        self.ready.clear()
        self.membership.unwatch()
        self.partitions.drop()
        self.partitions.forget()  # read afresh on the rejoin
        self.membership.end(revoke=True)  # our member key and claims go at once
