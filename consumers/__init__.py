"""partq's consumer side: the daemon and its handler API.

>>> def handle(message: consumers.Message) -> None:   # doctest: +SKIP
...     print(message.key, message.body)               # returning acks the message
>>> consumers.run("orders", handle)                    # doctest: +SKIP

``run`` returns an exit code for ``sys.exit``: the daemon's (``partq.consumers.control.daemon``: 0
after
a clean drain, 1, 3-6 after a failure), or, when it cannot start, 2 for a usage error (a bad
handler, setting or config value such as ``weight=0``) and 1 otherwise (no such stream,
etcd unreachable), after one logged line. It logs as ``partq consume`` does (JSON lines on
stderr, text on a terminal) unless the application has configured logging already.
"""

from __future__ import annotations

from partq.consumers.control.daemon import Consumer, ConsumerConfig
from partq.consumers.control.signals import on_stop_signals
from partq.consumers.handling.entry import entry_point
from partq.consumers.handling.message import Handler, Message, check_handler, load_handler
from partq.producer.registry import Registry

from partq.kernel.settings import Settings

__all__ = ["Consumer", "ConsumerConfig", "Handler", "Message", "load_handler", "run"]


@entry_point  # partq's logging unless the application's; a start-up error: one line, a code
def run(
    stream: str,
    handler: Handler,
    *,
    settings: Settings | None = None,
    install_signal_handlers: bool = True,
    **config: object,
) -> int:
    """Consume ``stream`` with ``handler`` until SIGTERM/SIGINT; returns an exit code.

    The first signal drains (finish and ack what was delivered, release the
    partitions, revoke the lease) within ``drain_timeout``; a second exits at once.

    ``settings``: etcd, RabbitMQ and the consumer settings (default: ``Settings.load()``,
    the environment and ``partq.toml``); ``install_signal_handlers``: stop on SIGTERM/SIGINT.
    The other keywords are ``partq consume``'s options (:class:`ConsumerConfig`), over
    the settings: ``member_id``, ``weight``, ``prefetch``, ``ttl``, ``heartbeat``,
    ``max_attempts``, ``retry_backoff``, ``drain_timeout``, ``partitions``,
    ``handler_timeout``, ``announce_leave``, ``announce_wait``, ``load_report``,
    ``amqp_outage_limit``, ``concurrency``, ``stall_after``, ``handoff``. Any other
    keyword (``http_port``: the CLI's server) is a usage error, exit 2.
    """
    check_handler(handler)  # a generator: a usage error before anything connects
    settings = settings or Settings.load()
    consumer_config = ConsumerConfig.of(stream, settings, **config)  # before connecting too
    registry = Registry.connect(settings)
    consumer = Consumer(registry, handler, consumer_config, amqp_url=settings.amqp)
    if install_signal_handlers:
        on_stop_signals(consumer.stop)
    try:
        return consumer.run()
    finally:
        registry.close()
