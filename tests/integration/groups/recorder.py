"""Handlers for the invariant tests' consumer processes.

``record`` is :func:`consumers.examples.record_handler` (one JSON line per handling
to ``$PARTQ_RECORD``); ``poison`` raises for bodies containing ``poison``.
"""

from __future__ import annotations

from consumers.examples import record_handler as record
from consumers.message import Message

__all__ = ["poison", "record"]


def poison(message: Message) -> None:
    if b"poison" in message.body:
        raise ValueError(f"poison message {message.message_id}")
    record(message)
