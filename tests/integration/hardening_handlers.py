"""Handlers that misbehave, for tests/integration/test_consumer_hardening.py's consumers.

``misbehave`` records (like ``examples.handlers.record_handler``) every message
it handles, except bodies that ask it to misbehave: ``sys-exit`` calls
``sys.exit(7)``, ``interrupt`` raises ``KeyboardInterrupt``, ``hang`` blocks
forever, ``hang-hard`` first starts a non-daemon thread that never ends (which
keeps a plain interpreter exit waiting forever) and then blocks forever. A
misbehaving attempt is never recorded.
"""

from __future__ import annotations

import sys
import threading

from partq.consumers.handling.message import Message

from examples.handlers import record_handler

__all__ = ["asynchronous", "asynchronous_object", "lazy", "misbehave"]

_FOREVER = threading.Event()


def misbehave(message: Message) -> None:
    if b"sys-exit" in message.body:
        sys.exit(7)
    if b"interrupt" in message.body:
        raise KeyboardInterrupt
    if b"hang-hard" in message.body:
        threading.Thread(target=_FOREVER.wait, name="never-ends", daemon=False).start()
    if b"hang" in message.body:
        _FOREVER.wait()
    record_handler(message)


async def asynchronous(message: Message) -> None:
    record_handler(message)


class _Asynchronous:
    async def __call__(self, message: Message) -> None:
        record_handler(message)


asynchronous_object = _Asynchronous()


def lazy(message: Message) -> object:
    if b"lazy" in message.body:
        return asynchronous(message)
    record_handler(message)
    return None
